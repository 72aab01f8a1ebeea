"""The node agent, ``sessionfleet agent``: one per GPU node.

- :mod:`.telemetry`: NVML telemetry per GPU and per process as Prometheus metrics;
- :mod:`.cgroups`: a process's pod and container from its cgroup (pure parsing);
- :mod:`.server`: the HTTP server (``/metrics``, ``/capability``, the ``criu`` driver's
  ``/checkpoint`` and ``/restore``, ``/healthz`` and ``/readyz``), its background loops
  supervised;
- :mod:`.cli`: the subcommand.
"""
