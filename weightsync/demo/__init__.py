"""``weightsync demo``, the main job: an application on top of :mod:`weightsync.impl`.

An asynchronous GRPO loop: a Hugging Face trainer syncs its weights into the reference DP engines after
every step, with the next rollouts in flight, and checks every sync.

- :mod:`weightsync.demo.loop`: the loop (:func:`~weightsync.demo.loop.run_demo`);
- :mod:`weightsync.demo.config`: its settings, per-sync record and errors;
- :mod:`weightsync.demo.checks`: the post-sync checks and the run's verdicts;
- :mod:`weightsync.demo.guard`: the engine client, failing fast when an engine process dies;
- :mod:`weightsync.demo.worker`: the engine-side hooks (probe logits, the test-only kill switch);
- :mod:`weightsync.demo.render`: the table, progress bar and summary for people;
- :mod:`weightsync.demo.trainer`: the trainer (policy model, GRPO step, probe logits);
- :mod:`weightsync.demo.rl_task`: the byte tokenizer, the digit-pattern task and its reward.

The same loop on a real vLLM is :mod:`weightsync.vllm_tools.demo` (it imports vllm, so it lives there); the
command is :mod:`weightsync.cli.demo`.
"""
