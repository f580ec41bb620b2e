"""Loss masks: the supervised tokens decode to exactly the assistant turns, per template."""

from __future__ import annotations

import json

import pytest

from data_pipelines.formats import FormatConfig, RowError, normalize
from data_pipelines.render import ChatRenderer, load_tokenizer

# Llama-3 style: bos, header tokens, <|eot_id|>, a default system prompt, trimmed content.
LLAMA3 = (
    "{{ bos_token }}"
    "{% if messages[0]['role'] == 'system' %}{% set sys = messages[0]['content'] %}"
    "{% set msgs = messages[1:] %}{% else %}"
    "{% set sys = 'Cutting Knowledge Date: December 2023\\nToday Date: 26 Jul 2024' %}"
    "{% set msgs = messages %}{% endif %}"
    "<|start_header_id|>system<|end_header_id|>\n\n{{ sys }}<|eot_id|>"
    "{% for m in msgs %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n"
    "{% endif %}"
)
LLAMA3_SPECIALS = ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]

# No end-of-turn token at all: turns end with plain newlines.
PLAIN = (
    "{% for m in messages %}{{ m['role'] | capitalize }}: {{ m['content'] }}\n\n{% endfor %}"
    "{% if add_generation_prompt %}Assistant: {% endif %}"
)

# Qwen3 style: reasoning shown only on the last assistant turn, so earlier turns render
# differently once later turns follow (the prefix renders are not prefixes of the full).
LAST_REASONING = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}<|im_start|>assistant\n"
    "{% if loop.last and m.get('reasoning_content') %}"
    "<think>{{ m['reasoning_content'] }}</think>{% endif %}"
    "{{ m['content'] }}<|im_end|>\n"
    "{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


# Generation prompt opens the think block (thinking models): the model writes the rest.
THINK_PROMPT = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' %}<think>{{ m.get('reasoning_content', '') }}</think>"
    "{% endif %}{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n<think>{% endif %}"
)


@pytest.fixture(scope="module")
def tok(tiny_target_dir):
    return load_tokenizer(tiny_target_dir)


@pytest.fixture(scope="module")
def llama_tok(tiny_target_dir):
    t = load_tokenizer(tiny_target_dir)
    t.add_tokens(LLAMA3_SPECIALS, special_tokens=True)
    t.chat_template = LLAMA3
    return t


def with_template(tiny_target_dir, template: str):
    t = load_tokenizer(tiny_target_dir)
    t.chat_template = template
    return t


def supervised_runs(tok, row, fmt: FormatConfig | None = None, kwargs=None, max_length=4096):
    """Decoded runs of consecutive supervised tokens (and the Encoded row)."""
    r = ChatRenderer(tok, kwargs)
    conv = normalize(row, fmt or FormatConfig())
    r.check_specials(conv)
    enc = r.encode([r.layout(conv)], max_length)[0]
    runs, cur = [], []
    for t, m in zip(enc.input_ids, enc.loss_mask, strict=True):
        if m:
            cur.append(t)
        elif cur:
            runs.append(cur)
            cur = []
    if cur:
        runs.append(cur)
    return [tok.decode(x, skip_special_tokens=False) for x in runs], enc


MULTI = {
    "messages": [
        {"role": "system", "content": "You are a careful assistant."},
        {"role": "user", "content": "Name a prime."},
        {"role": "assistant", "content": "7 is prime ☃."},
        {"role": "user", "content": "Another, in Japanese?"},
        {"role": "assistant", "content": "五 (five) 🙂"},
    ]
}


def test_pairs_tiny_template(tok):
    row = {"question": "What is 3*4?", "answer": "3*4 = <<3*4=12>>12\n#### 12"}
    runs, enc = supervised_runs(tok, row)
    assert runs == ["3*4 = <<3*4=12>>12\n#### 12<|im_end|>"]
    assert len(enc.input_ids) == len(enc.loss_mask) and not enc.truncated
    runs, _ = supervised_runs(tok, {"q": "hi", "a": "there"}, FormatConfig("pairs", "q", "a"))
    assert runs == ["there<|im_end|>"]


def test_sharegpt_multiturn_system_field(tok):
    row = {
        "system": "Be brief.",
        "conversations": [
            {"from": "human", "value": "Who are you?"},
            {"from": "gpt", "value": "A model."},
            {"from": "human", "value": "Bye"},
            {"from": "gpt", "value": "Bye!\n"},
        ],
    }
    runs, _ = supervised_runs(tok, row)
    assert runs == ["A model.<|im_end|>", "Bye!\n<|im_end|>"]


def test_messages_multiturn_and_recipe_system_prompt(tok):
    runs, _ = supervised_runs(tok, MULTI)
    assert runs == ["7 is prime ☃.<|im_end|>", "五 (five) 🙂<|im_end|>"]
    row = {"messages": MULTI["messages"][1:]}
    runs, enc = supervised_runs(tok, row, FormatConfig(system_prompt="Recipe system."))
    assert runs == ["7 is prime ☃.<|im_end|>", "五 (five) 🙂<|im_end|>"]
    assert "Recipe system." in tok.decode(enc.input_ids)


def test_reasoning_tool_calls_and_thinking_kwarg(tok):
    call = {"type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}
    first = {"role": "assistant", "content": "", "reasoning_content": "Use add."}
    row = {
        "messages": [
            {"role": "user", "content": "1+2?"},
            {**first, "tool_calls": [call]},
            {"role": "tool", "content": "3"},
            {"role": "assistant", "content": "<think>It said 3.</think>The sum is 3."},
        ]
    }
    runs, _ = supervised_runs(tok, row)
    assert runs == [
        f"<think>Use add.</think><tool_call>{json.dumps([call])}</tool_call><|im_end|>",
        "<think>It said 3.</think>The sum is 3.<|im_end|>",  # inline think split and rendered
    ]
    # enable_thinking=False puts "<think></think>" in the generation prompt only: the
    # rendering of a plain turn has none, and nothing of the prompt is supervised
    runs, _ = supervised_runs(tok, MULTI, kwargs={"enable_thinking": False})
    assert runs == ["7 is prime ☃.<|im_end|>", "五 (five) 🙂<|im_end|>"]


def test_generation_prompt_that_opens_think_is_not_supervised(tiny_target_dir):
    t = with_template(tiny_target_dir, THINK_PROMPT)
    row = {"messages": [MULTI["messages"][1], {**MULTI["messages"][2], "reasoning": "r1"}]}
    runs, _ = supervised_runs(t, row)
    assert runs == ["r1</think>7 is prime ☃.<|im_end|>"]  # "<think>" came with the prompt


def test_llama3_style_template_default_system(llama_tok):
    runs, enc = supervised_runs(llama_tok, {"messages": MULTI["messages"][1:]})
    assert runs == ["7 is prime ☃.<|eot_id|>", "五 (five) 🙂<|eot_id|>"]
    text = llama_tok.decode(enc.input_ids)
    assert text.startswith("<|bos|><|start_header_id|>system") and "Cutting Knowledge" in text
    runs, _ = supervised_runs(llama_tok, {"question": "  padded  ", "answer": "  trimmed \n"})
    assert runs == ["trimmed<|eot_id|>"]  # the template trims; the mask follows the render


def test_template_without_end_of_turn_token(tiny_target_dir):
    t = with_template(tiny_target_dir, PLAIN)
    runs, _ = supervised_runs(t, MULTI)
    # no separator newlines; " 7" is one BPE token straddling the template's space, so it
    # is supervised whole (it is the first answer token the model must produce)
    assert runs == [" 7 is prime ☃.", "五 (five) 🙂"]
    runs, enc = supervised_runs(t, {"question": "q", "answer": "x"})
    assert runs == [" x"] and not enc.has_pair  # one token: prepare rejects such a row


def test_template_that_drops_earlier_reasoning(tiny_target_dir):
    t = with_template(tiny_target_dir, LAST_REASONING)
    row = {
        "messages": [
            {"role": "user", "content": "q1"},
            {"role": "assistant", "content": "a1", "reasoning_content": "r1"},
            {"role": "user", "content": "q2"},
            {"role": "assistant", "content": "a2", "reasoning_content": "r2"},
        ]
    }
    runs, _ = supervised_runs(t, row)
    assert runs == ["a1<|im_end|>", "<think>r2</think>a2<|im_end|>"]


def test_truncation_keeps_ids_and_mask_aligned(tok):
    row = {"question": "q " * 20, "answer": "word " * 200}
    runs, enc = supervised_runs(tok, row, max_length=64)
    assert enc.truncated and len(enc.input_ids) == len(enc.loss_mask) == 64
    assert len(runs) == 1 and ("word " * 200).startswith(runs[0]) and enc.has_pair


def test_template_error_and_special_tokens_are_row_errors(tiny_target_dir, tok):
    t = with_template(tiny_target_dir, "{{ raise_exception('no system allowed') }}")
    with pytest.raises(RowError) as e:
        supervised_runs(t, MULTI)
    assert e.value.reason == "template_error" and "no system allowed" in e.value.detail
    with pytest.raises(RowError) as e:
        supervised_runs(tok, {"question": "see <|im_start|>", "answer": "a"})
    assert e.value.reason == "special_token_in_content"
