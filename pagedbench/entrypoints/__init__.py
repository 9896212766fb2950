"""Entry points: LLM (offline), AsyncLLM (asyncio), the OpenAI-compatible server and the CLI."""
