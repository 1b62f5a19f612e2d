"""Collaborative learning where the data stays on the devices (PiPar's pipelined split learning)
and its federated-averaging baseline (docs/design.md §13).

Pure parts: ``fedavg`` (weighted averaging), ``partition`` (splitting a data set among devices),
``planner`` (split point and number of micro-batches from profiles), ``rounds`` (who is in a round),
``parts`` (the compute of the device part and of a server replica), ``privacy`` (Opacus DP-SGD).
Edges: ``client`` (a data-owning device), ``server``, ``coordinator`` (the controller of these
modes), ``entry`` (processes) and ``demo``.
"""
