"""Weights on their way from the learner to the rollout engines: one home for the wire format, the
Hugging Face weight I/O and both transports.

    wire.py        WeightBucket (HF-named tensors, a policy version, an index and a last flag),
                   ``buckets`` to cut a model into them, ``assemble`` to join them, Publication
    hf_io.py       a folder's safetensors; MoE experts one tensor per expert, as publications name them
    broadcast.py   the broadcast transport: WeightBroadcastGroup (learner rank 0 and one rank per
                   engine; NCCL or gloo) and the Membership each engine process keeps

The publish side is the learner's (learner/worker.py: ``publish`` puts buckets into Ray's object
store, ``broadcast`` sends them over the group; learner/group.py drives every rank), the receive
side the engines' (rollout/engine.py ``update_weights`` and ``receive_weights``, implemented by each
engine); ``learner.weight_sync`` chooses the transport, and the controller decides when to publish
and whom to retry (controller/ray_backend.py, controller/broadcast_sync.py for the broadcast).

It lives under learner/ because the learner is where weights come from and what defines their
names; rollout/ imports this subpackage and nothing else of learner/, and nothing here imports the
learner's model or optimizer code (torch, safetensors and torch.distributed only).
"""
