"""Online run-ut over the network: the training side's sender (:mod:`.sender`), what crosses
the wire (:mod:`.wire`); the checker that receives it (``dispatchprobe run-ut --listen``) is
:mod:`dispatchprobe.offline.online_checker`.
Framework-neutral; needs ``grpcio`` (``pip install dispatchprobe[online]``)."""
