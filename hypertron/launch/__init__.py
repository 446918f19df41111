"""Getting a training job onto machines: recipes per model x machine (:mod:`.recipes`), local
processes (:mod:`.local`), Kubernetes JobSet + Kueue objects rendered and validated before
anything is applied (:mod:`.k8s`, :mod:`.validate`) and the cluster calls (:mod:`.cluster`).

``launch`` starts ``hypertron train`` as a command; it never imports the training loop.
"""
