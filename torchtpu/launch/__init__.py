"""Starting a torchtpu job on every host: `torchtpu-launch local | tpu-vm | gke | skypilot`.

torchtpu writes no scheduler. Each host runs one torchelastic agent (agent.py: `torchrun` with
TPU exit codes and per-host logs) around one training process; the subcommands only put those
agents on hosts:

- local.py    N agents on this machine, K XLA CPU devices each (the tested stand-in for a pod)
- tpu_vm.py   one agent per Cloud TPU VM worker over `gcloud ... ssh --worker=all`, after a
              preflight for stale TPU holders; MEGASCALE_* for multislice
- render.py   a GKE JobSet manifest (and the equivalent `xpk workload create`) and a SkyPilot
              task, rendered from templates/ for the user to apply
"""
