"""`llamapy serve`: an OpenAI-compatible HTTP server over the engine (llama.cpp's
tools/server). `protocol` has the request/response shapes (no web framework needed);
`app` the routes (needs the `llamapy[server]` extra: FastAPI, uvicorn, sse-starlette)."""
