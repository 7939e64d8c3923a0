"""`python -m experiments.mcp_server ...`: the installed `ear-mcp-server` program
(`ear_jax.agent.mcp_cli`), kept under its earlier name."""
from ear_jax.agent.mcp_cli import main

if __name__ == "__main__":
  main()
