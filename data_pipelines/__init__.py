"""Training data: prepare chat rows into token ids + loss masks; regenerate answers.

prepare.py     prepare_dataset(recipe, split) and `python -m data_pipelines.prepare`
pipeline.py    one prepare run: read, normalise, render, mask, write data/rejects/report
ingest.py      robust jsonl / json / parquet row reading (bad lines become rejects)
formats.py     sharegpt / messages / pairs -> validated messages; reject reasons
render.py      chat-template rendering and the assistant-only loss mask
regenerate.py  `python -m data_pipelines.regenerate`: the target answers the prompts
backends.py    OpenAI-compatible server (asyncio + aiohttp) and local hf generate
journal.py     exactly-once, resumable jsonl output
"""
