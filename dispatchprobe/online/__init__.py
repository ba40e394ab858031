"""Online run-ut over the network: the training side's sender (:mod:`.sender`), the checker
(:mod:`.checker`, ``dispatchprobe run-ut --listen``) and what crosses the wire (:mod:`.wire`).
Framework-neutral; needs ``grpcio`` (``pip install dispatchprobe[online]``)."""
