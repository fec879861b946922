"""Old home of the bridge's packing plan, now colomem.bridge.buckets: this alias keeps imports of
colomem._bucket working until they move to the new path."""

from colomem.bridge.buckets import (ALIGN, BucketMessage, Entry, PlannedBucket, Reassembler, align_up,
                                    dtype_from_name, dtype_name, entry_view, layout_digest, pack_bucket,
                                    plan_buckets)

__all__ = ["ALIGN", "BucketMessage", "Entry", "PlannedBucket", "Reassembler", "align_up", "dtype_from_name",
           "dtype_name", "entry_view", "layout_digest", "pack_bucket", "plan_buckets"]
