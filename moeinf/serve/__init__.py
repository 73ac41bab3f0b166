"""Serving a MoE model: an OpenAI-compatible HTTP server (`app.create_app`), its request batching
(`batcher.Batcher`), the model-side contract it runs on (`backend.Backend`, `backend.HFBackend`),
metrics, and the loader the CLI uses (`loader.load_backend`). fastapi and uvicorn (the `serve` extra)
are imported only by `app` and the serve command."""
