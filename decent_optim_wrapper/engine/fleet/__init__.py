"""The fleet: who is in the job, how its ranks agree and wait, and how members are lost and gained.

* :mod:`~decent_optim_wrapper.engine.fleet.replicas` -- a job of nodes: the shard worlds between nodes.
* :mod:`~decent_optim_wrapper.engine.fleet.heartbeats` -- each process's counter in the store, and how
  often a wait on the store looks again.
* :mod:`~decent_optim_wrapper.engine.fleet.jobs` -- the elastic job a process is in, published under its
  name for joiners to find.
* :mod:`~decent_optim_wrapper.engine.fleet.signatures` -- what a joiner must share with the job, and the
  first difference, by name.
* :mod:`~decent_optim_wrapper.engine.fleet.admission` -- a running job's applicants and the members' decision.
* :mod:`~decent_optim_wrapper.engine.fleet.world` -- the gossip world: the whole job, or one dimension of
  a device mesh or a process group.
* :mod:`~decent_optim_wrapper.engine.fleet.comm` -- cross-rank agreement, the process groups of every
  gossip world, and how to wait for a collective (timed on CPU, stream-ordered on CUDA).
* :mod:`~decent_optim_wrapper.engine.fleet.membership` -- surviving a lost peer: heartbeats, the
  failure-aware wait, the survivors' agreement through the store.
* :mod:`~decent_optim_wrapper.engine.fleet.sealing` -- the job secret: store entries and replica digests
  only the job's members can have written.
* :mod:`~decent_optim_wrapper.engine.fleet.transfer` -- a replica handed to a joiner, checked by its digest.
* :mod:`~decent_optim_wrapper.engine.fleet.growth` -- a rank's side of joins: donating, joining, the record.

Imports: torch, :mod:`decent_optim_wrapper.topo` and :mod:`decent_optim_wrapper.engine.errors`. The
fleet knows nothing of buckets, gossip rounds or update rules: the engine hands it callbacks (what to
save, how to settle and rewire) where a change of members touches them.
"""
