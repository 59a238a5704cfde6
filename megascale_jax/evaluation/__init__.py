"""Downstream evaluation scored exactly as EleutherAI's lm-evaluation-harness scores it.

    tasks          a task once loaded (items as strings), and this project's JSONL task file
    lm_eval_yaml   an lm-eval task YAML with local data, rendered as lm-eval renders it
    requests       items -> (context, continuation) token requests, as lm-eval's HFLM builds them
    batching       requests -> fixed-shape numpy batches -> per-request scores (any device layout)
    metrics        acc, acc_norm, perplexities, bits per byte and their stderr, as lm-eval's
    scoring        the one-device `score_batch` (the model's forward + log-softmax)
    evaluator      prepare (tokenise, check) then score a task
    table          lm-eval's results table and JSON

`python -m megascale_jax.evaluate` uses all of them; the training loop needs only a
`score_batch` of its own on the mesh. Nothing here downloads anything.
"""
