"""One device's engine: KV cache manager, scheduler, model runner, sampler and the step loop.
No ray, no network."""
