"""Training data: prepare chat rows into token ids + loss masks; regenerate answers.

prepare.py     prepare_dataset(recipe, split) and `python -m data_pipelines.prepare`
pipeline.py    one prepare run: read, normalise, render, mask, write data/rejects/report
ingest.py      robust jsonl / json / parquet row reading (bad lines become rejects)
formats.py     sharegpt / messages / pairs -> validated messages; reject reasons
render.py      chat-template rendering and the assistant-only loss mask
regenerate.py  `python -m data_pipelines.regenerate`: the target answers the prompts
regen_jobs.py  its input rows -> jobs, one per answer ("<id>#k" for further samples)
backends.py    OpenAI-compatible server, SGLang /generate (asyncio + aiohttp), local hf
journal.py     exactly-once, resumable jsonl output

Imports: config, engines, targets
"""
