"""The agent layer: `memory/` (the stateful `Memory` and its parts), `llm/` (LLM clients, critic,
local server, QA) and `mcp_server` (a `Memory` served over the Model Context Protocol)."""
