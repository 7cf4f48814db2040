"""A second KV tier under the block pool: evicted prefix blocks kept as bytes on disk (Chapter 13).

The pool (:mod:`~infer_lab.cache.block_pool`) keeps a named block's K/V only until the block is
handed out for something else. A returning conversation whose prefix was evicted meanwhile is
recomputed from scratch, though its K/V was the same as before. This module catches the block
on its way out: :class:`KVTier` is the pool's ``on_evict`` hook, and writes the block's bytes to
a :class:`KVByteStore` under the block's key (the SHA-256 digest chain of
:func:`~infer_lab.cache.block_pool.block_key`, the same in every process). On a later prefix
lookup, :meth:`KVTier.reload` continues where the pool's own hits stop: each next key found in
the store is read into a fresh block, named, and counted as computed, instead of recomputed
(vLLM's CPU offloading connector, SGLang's HiCache, llama.cpp's ``--cache-ram``).

What may go wrong must cost a recompute, never wrong K/V:

- Every file carries a header: a magic, the **namespace** (a digest of the model, its weights,
  the dtype and the block size: K/V from another model under the same token digest would be
  wrong, silently), the key, the payload's length and its SHA-256. A reload checks all of them;
  a torn, truncated or corrupted file is a miss (and is deleted).
- A file is written to a temporary name and renamed into place, so a crash mid-write leaves no
  half file under a key. A write that fails (disk full, permissions) is a miss later, counted
  in ``write_errors``; the engine goes on.
- The store is bounded in bytes: past ``capacity_bytes`` the least recently used files go.
"""

from __future__ import annotations

import hashlib
import os
import struct
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from infer_lab.cache.block_pool import BlockKey, BlockPool
from infer_lab.cache.paged import PagedKVCache

MAGIC = b"ILKVT001"
_HEADER = struct.Struct("<8s32s32sQ32s")  # magic, namespace, key, payload length, payload digest


@dataclass
class TierStats:
    """What the store did: blocks written, read back, missed, found corrupt, failed to write."""

    puts: int = 0
    hits: int = 0
    misses: int = 0
    corrupt: int = 0
    write_errors: int = 0
    evictions: int = 0


class KVByteStore:
    """Block payloads in files under ``root``, keyed by block digest, LRU-bounded in bytes.

    Files of one ``namespace`` (see :func:`cache_namespace`) live in their own folder; files
    already there from an earlier process are indexed at start (oldest first), so a restarted
    server finds its old prefixes.
    """

    def __init__(self, root: str | os.PathLike, capacity_bytes: int, namespace: bytes) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be positive, got {capacity_bytes}")
        if len(namespace) != 32:
            raise ValueError("the namespace is a 32-byte digest (cache_namespace)")
        self.capacity_bytes, self.namespace = capacity_bytes, namespace
        self.dir = Path(root) / namespace.hex()[:16]
        self.dir.mkdir(parents=True, exist_ok=True)
        self.stats = TierStats()
        self._lru: OrderedDict[BlockKey, int] = OrderedDict()  # key -> file size, oldest first
        self.bytes_used = 0
        self._index_existing()

    def __contains__(self, key: BlockKey) -> bool:
        return key in self._lru

    def __len__(self) -> int:
        return len(self._lru)

    def path(self, key: BlockKey) -> Path:
        return self.dir / f"{key.hex()}.kv"

    def put(self, key: BlockKey, payload: bytes) -> bool:
        """Keep ``payload`` under ``key``; False if it could not be written (then it is a miss)."""
        if key in self._lru:
            self._lru.move_to_end(key)
            return True
        size = _HEADER.size + len(payload)
        if size > self.capacity_bytes:
            return False
        header = _HEADER.pack(MAGIC, self.namespace, key, len(payload),
                              hashlib.sha256(payload).digest())
        path = self.path(key)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        try:
            with open(tmp, "wb") as f:
                f.write(header)
                f.write(payload)
            os.replace(tmp, path)
        except OSError:
            self.stats.write_errors += 1
            tmp.unlink(missing_ok=True)
            return False
        self._lru[key] = size
        self.bytes_used += size
        self.stats.puts += 1
        self._shrink()
        return True

    def get(self, key: BlockKey) -> bytes | None:
        """The payload under ``key``, or None: absent, or failing any check (then deleted)."""
        if key not in self._lru:
            self.stats.misses += 1
            return None
        try:
            data = self.path(key).read_bytes()
        except OSError:
            data = b""
        payload = self._check(key, data)
        if payload is None:
            self.stats.corrupt += 1
            self.discard(key)
            return None
        self._lru.move_to_end(key)
        self.stats.hits += 1
        return payload

    def discard(self, key: BlockKey) -> None:
        size = self._lru.pop(key, None)
        if size is not None:
            self.bytes_used -= size
        self.path(key).unlink(missing_ok=True)

    def _check(self, key: BlockKey, data: bytes) -> bytes | None:
        if len(data) < _HEADER.size:
            return None
        magic, namespace, stored_key, length, digest = _HEADER.unpack_from(data)
        payload = data[_HEADER.size:]
        ok = (magic == MAGIC and namespace == self.namespace and stored_key == key
              and length == len(payload) and hashlib.sha256(payload).digest() == digest)
        return payload if ok else None

    def _shrink(self) -> None:
        while self.bytes_used > self.capacity_bytes and self._lru:
            key = next(iter(self._lru))
            self.discard(key)
            self.stats.evictions += 1

    def _index_existing(self) -> None:
        files = []
        for path in self.dir.glob("*.kv"):
            try:
                key = bytes.fromhex(path.stem)
                stat = path.stat()
            except (ValueError, OSError):
                continue
            if len(key) == 32:
                files.append((stat.st_mtime, key, stat.st_size))
        for _, key, size in sorted(files):
            self._lru[key] = size
            self.bytes_used += size
        self._shrink()


def cache_namespace(model: torch.nn.Module, block_size: int, kv_cache_dtype: str) -> bytes:
    """A digest naming the K/V a block key stands for: same tokens give the same K/V only under
    the same weights, dtype, block size and cache format. Hashes the config and a sample of
    every parameter (its first 64 numbers and its shape), so two checkpoints of one architecture
    differ."""
    h = hashlib.sha256()
    h.update(repr(getattr(model, "config", None)).encode())
    h.update(f"{block_size}|{kv_cache_dtype}".encode())
    with torch.no_grad():
        for name, p in model.named_parameters():
            flat = p.detach().reshape(-1)[:64].float().cpu().contiguous()
            h.update(name.encode() + str(tuple(p.shape)).encode() + str(p.dtype).encode())
            h.update(flat.numpy().tobytes())
    return h.digest()


def _block_tensors(cache: PagedKVCache) -> list[torch.Tensor]:
    """The tensors holding a block, block index at dim 2: K/V, and an int8 cache's scales."""
    scales = getattr(cache, "scales", None)
    return [cache.kv] if scales is None else [cache.kv, scales]


def block_nbytes(cache: PagedKVCache) -> int:
    """Bytes of one block's payload (every layer, K and V, scales if any)."""
    return sum(t[:, :, 0].numel() * t.element_size() for t in _block_tensors(cache))


def read_block(cache: PagedKVCache, block: int) -> bytes:
    """The bytes of ``block`` in every layer (what the tier stores and the transfer sends)."""
    return b"".join(t[:, :, block].contiguous().view(torch.uint8).cpu().numpy().tobytes()
                    for t in _block_tensors(cache))


def write_block(cache: PagedKVCache, block: int, payload: bytes) -> None:
    """Put ``payload`` (from :func:`read_block` of a cache of the same shape) into ``block``."""
    if len(payload) != block_nbytes(cache):
        raise ValueError(f"a block payload of {len(payload)} bytes; this cache's blocks have "
                         f"{block_nbytes(cache)}")
    raw = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    at = 0
    for t in _block_tensors(cache):
        part = t[:, :, block]
        n = part.numel() * t.element_size()
        part.copy_(raw[at:at + n].view(t.dtype).view(part.shape))
        at += n


class KVTier:
    """The pool's second tier: offload named blocks as they are evicted, reload them on a hit."""

    def __init__(self, pool: BlockPool, cache: PagedKVCache, store: KVByteStore) -> None:
        if not pool.enable_caching:
            raise ValueError("a KV tier needs prefix caching (named blocks) in the pool")
        self.pool, self.cache, self.store = pool, cache, store
        self.reloaded_blocks = 0
        pool.on_evict = self.offload

    def offload(self, block: int, key: BlockKey) -> None:
        """The pool is about to hand ``block`` out again: keep its bytes under its key."""
        if key not in self.store:
            self.store.put(key, read_block(self.cache, block))

    def reload(self, keys: Sequence[BlockKey], held: Sequence[int]) -> list[int]:
        """Blocks for the longest run of ``keys`` found in the store, read back and named.

        ``held`` are the pool's own hits before ``keys``: they are held while fresh blocks are
        taken, so that taking a block never evicts a hit. The reloaded blocks are handed back to
        the free queue named (like any cached prefix), so the caller shares them the same way.
        """
        pool, loaded = self.pool, []
        pool.touch(held)
        try:
            for key in keys:
                if not pool.num_free_blocks or pool.get_cached_block(key) is not None:
                    break
                payload = self.store.get(key)
                if payload is None:
                    break
                (block,) = pool.get_new_blocks(1)
                try:
                    write_block(self.cache, block, payload)
                except ValueError:  # another shape under our namespace: a miss
                    pool.free_blocks([block])
                    self.store.discard(key)
                    break
                pool.cache_block(block, key)
                loaded.append(block)
        finally:
            pool.free_blocks(reversed(list(held) + loaded))
        self.reloaded_blocks += len(loaded)
        return loaded
