"""Serving the engine over HTTP: ``nanovllm serve``.

The server is a client of :class:`~nanovllm_core.engine.controller.EngineController`, exactly
as the app is: requests from any number of HTTP clients become controller submissions, and
the scheduler batches them continuously; the server adds no scheduling of its own.

- ``protocol.py``      OpenAI request bodies (pydantic) -> ``SamplingParams``; error bodies
- ``request_stream.py`` one HTTP request's engine outputs, handed from the engine thread to the event loop
- ``openai_serving.py`` ``/v1/completions`` and ``/v1/chat/completions`` responses, whole or streamed (SSE)
- ``event_hub.py``     the engine's event stream for attached apps (SSE of trace lines), and their commands
- ``metrics.py``       ``/metrics`` in Prometheus text format, with vLLM's metric names
- ``api_server.py``    the FastAPI app, API-key check, uvicorn and a shutdown that aborts in-flight requests
- ``cli.py``           the ``nanovllm serve`` command line
"""
