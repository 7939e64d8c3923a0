"""`python -m experiments.llm_server ...`: the installed `ear-llm-server` program
(`ear_jax.agent.llm.server_cli`), kept under its earlier name."""
from ear_jax.agent.llm.server_cli import main

if __name__ == "__main__":
  main()
