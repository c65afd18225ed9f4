"""Rounds: every decode step, plain or speculative, is a *round* run by a round worker.

* :mod:`.contract` — what a round worker is (:class:`~.contract.RoundWorker`): its prefill, its
  round as fixed-shape phases a CUDA graph can capture, the hooks the graph runner calls, and
  the extra contract of a speculative worker (:class:`~.contract.SpecWorker`).
* :mod:`.plain` — the target's worker (:class:`~.plain.TpModelWorker`), whose round is one
  token per request.
* :mod:`.relay` — what round ``k`` hands round ``k + 1`` on the device (:class:`~.relay.FutureMap`)
  and what the host reads one round late (:class:`~.relay.PendingRound`).
* :mod:`.registry` — ``--speculative-algorithm`` name -> the algorithm's folder (worker, flags);
  no algorithm is the plain worker.
* :mod:`.chain`, :mod:`.chain_sampling` — chain verification and its sampling maths, shared by
  the algorithms.
* One folder per algorithm: :mod:`.nextn`, :mod:`.dspark`.
"""
