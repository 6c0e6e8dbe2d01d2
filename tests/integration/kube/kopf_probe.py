"""A minimal kopf operator used to prove the emulator works for kopf (not the product operator)."""

import kopf


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, **_):
    settings.posting.level = 0
    settings.watching.server_timeout = 10


@kopf.on.create("specrl.io", "v1alpha1", "rljobs")
def created(body, name, namespace, uid, patch, **_):
    cm = {"apiVersion": "v1", "kind": "ConfigMap",
          "metadata": {"name": f"{name}-config", "namespace": namespace,
                       "labels": {"specrl.io/job": name},
                       "ownerReferences": [{"apiVersion": "specrl.io/v1alpha1", "kind": "RLJob", "name": name,
                                            "uid": uid, "controller": True, "blockOwnerDeletion": True}]},
          "data": {"job.yaml": "x"}}
    import kubernetes
    kubernetes.config.load_kube_config()
    # The client serializes a plain dict body as well as its V1ConfigMap model.
    kubernetes.client.CoreV1Api().create_namespaced_config_map(namespace, cm)  # type: ignore[arg-type]
    patch.status["phase"] = "Running"
    patch.status["step"] = 3


@kopf.on.delete("specrl.io", "v1alpha1", "rljobs")
def deleted(name, **_):
    pass
