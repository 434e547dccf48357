"""Objects: the bytes a store keeps, and their formats.

Packs of blobs and records (:mod:`~ckptstore.objects.packs`, one entry writer with a file
sink and an upload sink), pack indexes, commit records and manifests
(:mod:`~ckptstore.objects.records`), and the objects of a store on a bucket
(:mod:`~ckptstore.objects.bucketformat`). May import ``core`` and ``backends``; knows no
catalog, home or protocol.
"""
