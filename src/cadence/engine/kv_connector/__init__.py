"""The KV connector: prompt KV exchanged between prefill and decode engines, in two halves.

* `scheduler_side.SchedulerSideConnector` lives beside the scheduler and is pure Python
  (block ids, no torch). It parks a decode engine's requests on reserved blocks until
  their KV arrives, holds a prefill engine's computed prompts until their reader is done,
  and ends either by a deadline (`deadlines.KVDeadlines`). The scheduler calls it only
  through the hooks of `scheduler/connector.py`; the engine core calls it with the
  router's messages (load, cancel, extend, release) and takes its events.
* `worker_side.WorkerSideConnector` lives beside the model runner and moves the blocks
  over a transport (engine/kv_transfer/).

The halves never call each other. Each step the scheduler half's loads and cancels ride
down in the `SchedulerOutput` (`kv_loads`, `kv_cancels`), and the worker half's reports
ride back up in the `ModelRunnerOutput` (`kv_load_results`), which the engine core hands
to `SchedulerSideConnector.finish_kv_loads`. So the runner may live in another process.
A colocated engine builds neither half.
"""
