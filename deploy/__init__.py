"""Deployment: the Ray launcher behind ``pdserve launch`` (:mod:`deploy.ray_launcher`); beside it,
not Python, the Kubernetes manifests (``k8s/``), the container file (``Dockerfile``) and the
Grafana dashboard (``grafana/``)."""
