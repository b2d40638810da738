"""The OpenAI-compatible HTTP API: request preparation (deepseek-recipe) and the aiohttp server."""
