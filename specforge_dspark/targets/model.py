"""The tiny targets' tokenizer (a byte-level BPE with a chat template) and model configs
(transformers' Inkling, or Qwen3 of the same width and depth)."""

from __future__ import annotations

SPECIAL_TOKENS = [
    "<|pad|>",
    "<|bos|>",
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<|mask|>",
]

# ChatML-like template. Assistant turns may carry `reasoning_content` (rendered inside
# <think>) and `tool_calls`; `enable_thinking=false` closes an empty think block in the
# generation prompt (a chat-template kwarg, like real reasoning models have).
CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{{ '<|im_start|>' + m['role'] + '\\n' }}"
    "{% if m['role'] == 'assistant' and m.get('reasoning_content') %}"
    "{{ '<think>' + m['reasoning_content'] + '</think>' }}"
    "{% endif %}"
    "{% if m['content'] is string %}{{ m['content'] }}{% endif %}"
    "{% if m['role'] == 'assistant' and m.get('tool_calls') %}"
    "{{ '<tool_call>' + (m['tool_calls'] | tojson) + '</tool_call>' }}"
    "{% endif %}"
    "{{ '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\\n' }}"
    "{% if enable_thinking is defined and not enable_thinking %}{{ '<think></think>' }}{% endif %}"
    "{% endif %}"
)


def train_tokenizer(texts: list[str], vocab: int):
    """Byte-level BPE with our special tokens and chat template (offline, < 1 s)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|bos|>",
        eos_token="<|im_end|>",
        pad_token="<|pad|>",
        mask_token="<|mask|>",
        additional_special_tokens=SPECIAL_TOKENS[2:9],
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.model_max_length = 4096
    return fast


def make_config(tokenizer, hidden: int, layers: int, arch: str = "inkling"):
    from transformers.models.inkling import InklingTextConfig

    n_tok = len(tokenizer)
    padded = (n_tok // 64 + 1) * 64  # like Inkling: LM head rows > tokenizer entries
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    if arch == "qwen3":
        return _qwen3_config(tokenizer, hidden, layers, padded, im_end)
    cfg = InklingTextConfig(
        vocab_size=padded,
        unpadded_vocab_size=n_tok,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden // 4,
        swa_num_attention_heads=4,
        swa_num_key_value_heads=2,
        swa_head_dim=hidden // 4,
        sliding_window_size=128,
        d_rel=8,
        rel_extent=256,
        local_layer_ids=[i for i in range(layers) if i % 2 == 0],
        mlp_layer_types=["dense"] + ["sparse"] * (layers - 1),
        intermediate_size=2 * hidden,
        moe_intermediate_size=hidden // 2,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        logits_mup_width_multiplier=4.0,
        max_position_embeddings=4096,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=im_end,
        tie_word_embeddings=False,
    )
    cfg.architectures = ["InklingForCausalLM"]
    return cfg


def _qwen3_config(tokenizer, hidden: int, layers: int, padded: int, im_end: int):
    from transformers import Qwen3Config

    cfg = Qwen3Config(
        vocab_size=padded,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden // 4,
        intermediate_size=2 * hidden,
        max_position_embeddings=4096,
        rope_theta=1e6,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=im_end,
        tie_word_embeddings=False,
    )
    cfg.architectures = ["Qwen3ForCausalLM"]
    return cfg
