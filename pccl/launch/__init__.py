"""Starting a pccl run on the engines people already have: Slurm (:mod:`pccl.launch.slurm`)
and Ray (:mod:`pccl.launch.ray`); Kubernetes manifests are in ``deploy/kubernetes``.
See ``docs/operations.md``."""
