"""The elastic orchestration of a run, one concern a module: ``control`` (``ElasticControl``: what
happens between iterations — planned and requested resizes, node events, recovering a lost
trainer), ``resize`` (a resize of the trainer world and the vLLM replicas together), ``rebalance``
(the replicas' devices joining the trainer world for each update), ``lending`` (the trainer's
devices lent to the rollout) and ``nodes`` (Ray's node events). The mechanisms they drive — resize
plans, background worlds, host copies, recovery — are ``rlhf_switch.elastic``'s."""
