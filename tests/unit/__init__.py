"""Pure logic on its own: the scheduler, block tables, sampler, router state, the load
generator's parts, shutdown pieces; no model is run and no server is started."""
