"""The routes of the models that answer vectors, not text: each request is one `Pooling.Encode` call to a worker.

`embeddings` holds /v1/score, /v1/embeddings and /encode, and the helpers of the family; `classify` holds
/v1/rerank and /classify, built on them. Other route families import neither.
"""
