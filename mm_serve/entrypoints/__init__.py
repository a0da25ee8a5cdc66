"""Entry points: the OpenAI-compatible API server (``openai/``), the ``mm-serve`` CLI
(``cli``) and the offline ``LLM`` (``llm``), which may run the engine core in its own process."""
