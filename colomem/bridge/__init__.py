"""WeightBridge: the trainer's named tensors -> flat buckets that another process on the same machine maps.

Producer (trainer process)::

    bridge = WeightBridge(bucket_bytes=512 << 20, buffers=2, device=0)
    addr = bridge.address                              # a 0600 Unix socket in a fresh 0700 directory
    for msg in bridge.publish(named_tensors, version=v):
        ack = consumer_call(msg.to_dict())             # e.g. llm.collective_rpc("colomem_apply", ...)
    # or: bridge.sync(named_tensors, version=v)                 (messages and ACKs over the socket)
    #     bridge.sync(named_tensors, version=v, send=callable)  (callable's return is the ACK)
    bridge.close()

Consumer (e.g. vLLM's worker)::

    imp = BridgeImporter.connect(addr, timeout=30)     # same-uid check; maps the buffers on the GPU by UUID
    for name, t in imp.tensors(msg_dict, verify="sampled"):   # views into the mapped buffer, no copy
        ...
    # socket transport: for msg in imp.messages(timeout=30): load(imp.tensors(msg))   (ACK on resume)
    imp.close()

Double buffering: with `buffers=n`, up to n-1 buckets are packed (on a side stream) while the consumer
applies the current one. A buffer is refilled only after the consumer ACKed the message that used it: in
`publish`, resuming the generator after a message is that ACK, so call it only once the consumer is done.

`device="cpu"` puts the buffers in shared host memory (a memfd the importer maps) and packs them with host
copies: the same bridge, protocol and checks for processes without a GPU; the importer's views are CPU tensors.

The consumer's errors reach the producer as their own class: a refused ACK carries an error payload
(colomem.errors.error_payload) and `sync` raises it. On the consumer, `receive` raises PeerClosedError when the
producer closed the bridge and PeerAbortedError when it abandoned a version.

Modules: producer (WeightBridge), importer (BridgeImporter), wire (the socket protocol and ACK rules),
buckets (the packing plan and messages), buffers (CUDA VMM and host-memory buffers, packing per backend).
"""

from colomem.bridge.buckets import BucketMessage
from colomem.bridge.importer import BridgeImporter
from colomem.bridge.producer import BridgeStats, WeightBridge
from colomem.bridge.wire import CHECKSUM_STRIDES, PROTOCOL

__all__ = ["BridgeImporter", "BridgeStats", "BucketMessage", "CHECKSUM_STRIDES", "PROTOCOL", "WeightBridge"]
