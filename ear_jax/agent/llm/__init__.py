"""LLM clients for the agent: an OpenAI-compatible chat client (`client`, `config`, `cache`), the
citation critic (`citations`, `critic`), a local llama.cpp server (`server`, `_server_supervisor`)
and QA answering / judging (`qa`, `qa_prompts`). Independent of `ear_jax.agent.memory`."""
