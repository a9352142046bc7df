"""The aiohttp server: OpenAI-compatible HTTP with SSE, websocket chat, the chat page, metrics.

    cli.py            the `runtime` console script: runtime's commands plus `serve`
    serve.py          run until SIGTERM, then drain (stop accepting, grace period, cancel)
    app.py            routes, /health, /metrics, the chat page (static/)
    openai_api.py     /v1/chat/completions, /v1/completions, /v1/models
    websocket.py      /ws streaming chat
    protocol.py       request bodies -> GenerationRequest (validation, chat template, limits)
    generation.py     one request's sequences in the engine; usage and latency metrics
    engine_client.py  the only door to flotilla.runtime

Nothing imports this package; it sits at the top of the dependency graph.
"""
