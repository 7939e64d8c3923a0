"""ear_jax: Exploratory-Assimilating Reflection for adaptive memory retrieval, in JAX."""
import pathlib

import setuptools

_HERE = pathlib.Path(__file__).parent
CONSOLE_SCRIPTS = [
    "ear-mcp-server = ear_jax.agent.mcp_cli:main",
    "ear-llm-server = ear_jax.agent.llm.server_cli:main",
]


def _requirements():
  lines = (_HERE / "requirements.txt").read_text().splitlines()
  reqs = [l.split("#")[0].strip() for l in lines]
  return [r for r in reqs if r and not r.startswith(("pytest", "hypothesis"))]


setuptools.setup(
    name="ear_jax",
    version="0.1.0",
    description="Exploratory-Assimilating Reflection (EAR) for LLM-agent memory retrieval, in JAX.",
    long_description=(_HERE / "README.md").read_text() if (_HERE / "README.md").exists() else "",
    long_description_content_type="text/markdown",
    packages=setuptools.find_packages(include=["ear_jax", "ear_jax.*", "experiments", "experiments.*"]),
    python_requires=">=3.10",
    install_requires=_requirements(),
    extras_require={"test": ["pytest>=8,<10", "hypothesis>=6.100,<7"]},
    # The programs a user runs: the MCP memory server and the local LLM server.
    entry_points={"console_scripts": CONSOLE_SCRIPTS},
)
