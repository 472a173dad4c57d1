"""Jobs service: OpenAI Files and Batches with all state in Redis, batch items run through the gateway.

`app` serves the HTTP API; `worker` processes (`pdserve batch-worker`) execute batches; `store`,
`scripts` and `workqueue` own the Redis layout and its atomic transitions.
"""
