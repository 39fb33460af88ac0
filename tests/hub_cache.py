"""A Hugging Face Hub cache written on disk in huggingface_hub's own layout, so that tests load Hub model
ids offline:

    <cache>/models--ORG--NAME/blobs/<sha256>            the files' contents, once each
                              snapshots/<commit>/<file>  symlinks to ../../blobs/<sha256>
                              refs/<branch or tag>       the commit it points at
"""

from __future__ import annotations

import hashlib
import os


def repo_folder(cache_dir: str, repo_id: str) -> str:
    return os.path.join(cache_dir, "models--" + repo_id.replace("/", "--"))


def add_snapshot(cache_dir: str, repo_id: str, folder: str, commit: str, refs: tuple[str, ...] = ()) -> str:
    """Puts the files of `folder` into the cache as `repo_id` at `commit` (40 hex digits), with each of
    `refs` pointing at it; returns the snapshot folder."""
    assert len(commit) == 40 and all(c in "0123456789abcdef" for c in commit), commit
    repo = repo_folder(cache_dir, repo_id)
    snapshot = os.path.join(repo, "snapshots", commit)
    os.makedirs(os.path.join(repo, "blobs"), exist_ok=True)
    os.makedirs(snapshot, exist_ok=True)
    for name in sorted(os.listdir(folder)):
        with open(os.path.join(folder, name), "rb") as f:
            data = f.read()
        blob = os.path.join(repo, "blobs", hashlib.sha256(data).hexdigest())
        if not os.path.exists(blob):
            with open(blob, "wb") as f:
                f.write(data)
        os.symlink(os.path.relpath(blob, snapshot), os.path.join(snapshot, name))
    for ref in refs:
        os.makedirs(os.path.join(repo, "refs"), exist_ok=True)
        with open(os.path.join(repo, "refs", ref), "w") as f:
            f.write(commit)  # huggingface_hub writes the hash without a newline
    return snapshot
