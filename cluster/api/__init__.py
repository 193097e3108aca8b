"""The OpenAI-compatible HTTP front end, over any EngineClient (no ray here):

- ``client``: the EngineClient protocol the app serves (the Ray ingress, or a fake in tests);
- ``schemas``: OpenAI request/response models; requests turn into SamplingParams;
- ``serving``: a request -> its sample GenerateRequests -> an OpenAI response or SSE stream;
- ``sample_streams``: runs and merges one request's sample streams, cancels them on close;
- ``responses`` / ``logprobs``: the completions and chat shapes of choices, usage and logprobs;
- ``errors``: failures as OpenAI error bodies and statuses;
- ``metrics``: the Prometheus registry behind /metrics;
- ``server``: ``build_openai_app``, the FastAPI app and its routes.
"""
