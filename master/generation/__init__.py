"""Generation over a cluster's engine: batching, sampling, grammars, prompt reuse, speculation."""
