"""Gradient buckets: parameters grouped into flat buffers, each parameter's
gradient a view of its bucket, so one collective reduces a whole bucket in
place and the optimizer reads the result without a copy."""

from __future__ import annotations

import torch

# The first bucket's cap: small, so that the first reduction starts early in
# backward (the trainer's and DataParallel's, and the plan's model of them).
FIRST_BUCKET_MB = 1.0


class GradBucket:
    """One flat gradient buffer and the parameters whose gradients live in it.

    ``params`` are indices into the wrapper's parameter list, in the order the
    bucket lays them out; ``views[i]`` is params[i]'s gradient, a view of
    ``flat`` shaped like the parameter.
    """

    def __init__(
        self,
        index: int,
        params: list[int],
        tensors: list[torch.Tensor],
        shards: int = 0,
        allocate: bool = True,
    ):
        self.index = index
        self.params = params
        dtype, device = tensors[0].dtype, tensors[0].device
        self.numel = sum(t.numel() for t in tensors)
        self.element_size = tensors[0].element_size()
        # Sharded over `shards` ranks (ZeRO): `flat` is padded with zeros to
        # a multiple of it, and rank k owns flat[k * shard : (k + 1) * shard].
        self.shards = shards
        self.padded = -(-self.numel // shards) * shards if shards else self.numel
        self.shard = self.padded // shards if shards else 0
        self.shard_grad: torch.Tensor | None = None  # this rank's averaged shard
        self.scratch: torch.Tensor | None = None  # a later round's shard (ZeRO-2)
        self.dtype, self.device = dtype, device
        self.shapes = [t.shape for t in tensors]
        self.offsets: list[int] = []  # where each parameter starts in `flat`
        offset = 0
        for t in tensors:
            self.offsets.append(offset)
            offset += t.numel()
        self.flat: torch.Tensor | None = None
        self.views: list[torch.Tensor | None] = [None] * len(params)
        if allocate:  # (else made when needed: ZeRO-2 and 3)
            self.allocate()
        self.pending = len(params)  # gradients not yet ready this step

    def allocate(self) -> None:
        """A zeroed flat buffer and the views over it."""
        self.flat = self.zeros()
        self.views = [
            self.flat[o : o + shape.numel()].view(shape)
            for o, shape in zip(self.offsets, self.shapes, strict=True)
        ]

    def part(self) -> torch.Tensor:
        """This rank's part of a sharded bucket's gradient (``shard_grad``),
        made (zeroed) if it is not yet."""
        if self.shard_grad is None:
            self.shard_grad = torch.zeros(self.shard, dtype=self.dtype, device=self.device)
        return self.shard_grad

    def free_part(self) -> None:
        """Lets go of the part's storage (a bucket layout replaced: the old
        shards hold the part as their ``.grad`` until they are laid out anew)."""
        if self.shard_grad is not None:
            free_storage(self.shard_grad)

    def zeros(self) -> torch.Tensor:
        """A zeroed tensor laid out as ``flat`` (an error-feedback residual,
        for one), whether or not the bucket holds its buffer now."""
        return torch.zeros(self.padded, dtype=self.dtype, device=self.device)

    def release(self) -> None:
        """Lets go of the flat buffer (ZeRO-2, between steps)."""
        self.flat = None
        self.views = [None] * len(self.params)

    def segment(self, flat: torch.Tensor, slot: int) -> torch.Tensor:
        """Parameter ``slot``'s part of ``flat``, any flat tensor laid out
        like this bucket (its error-feedback residual, for one)."""
        start = self.offsets[slot]
        return flat[start : start + self.shapes[slot].numel()]

    @property
    def nbytes(self) -> int:
        return self.numel * self.element_size

    def __repr__(self) -> str:
        return f"<GradBucket {self.index}: {len(self.params)} params, {self.nbytes} bytes>"


def assign_buckets(
    order: list[int],
    tensors: list[torch.Tensor],
    cap_bytes: int,
    first_cap_bytes: int,
    kind=lambda i: None,
) -> list[list[int]]:
    """Groups parameter indices, taken in ``order``, into buckets of at most
    ``cap_bytes`` (the first at most ``first_cap_bytes``, so the first
    all-reduce starts early in backward). A parameter of at least half the
    cap gets a bucket of its own (so a replaced gradient can become the
    bucket's buffer without a copy: GradReducer.take_grad); a bucket holds
    one dtype and device, and one ``kind(i)`` (sharded or not)."""
    buckets: list[list[int]] = []
    current: list[int] = []
    size = 0
    cap = first_cap_bytes
    for i in order:
        t = tensors[i]
        nbytes = t.numel() * t.element_size()
        same_kind = not current or (
            tensors[current[0]].dtype == t.dtype
            and tensors[current[0]].device == t.device
            and kind(current[0]) == kind(i)
        )
        alone = 2 * nbytes >= cap
        if current and (size + nbytes > cap or not same_kind or alone):
            buckets.append(current)
            current, size, cap = [], 0, cap_bytes
        current.append(i)
        size += nbytes
        if alone:
            buckets.append(current)
            current, size, cap = [], 0, cap_bytes
    if current:
        buckets.append(current)
    return buckets


class BucketBuffers:
    """The gradient buffers of a list of buckets: what a reducer (which sets
    ``params``, ``buckets``, ``slot`` (param index -> (bucket, position))
    and ``_to_release``) does with the memory, apart from reducing it.

    Gradients that were replaced (``zero_grad(set_to_none=True)`` makes autograd
    hand over a fresh tensor) are put back in their bucket by ``take_grad``: a
    bucket that holds one parameter adopts the new tensor as its buffer, so no
    byte is copied; in a shared bucket the gradient is copied in. Parameters of
    at least half the bucket cap get a bucket of their own, so the big
    gradients, whose copies would cost the most, are the ones adopted.
    """

    def attach_grads(self) -> None:
        """Makes every parameter's ``.grad`` its bucket view (zeroed)."""
        for bucket in self.buckets:
            if bucket.flat is None:
                self.take_grad(bucket.params[0])
            bucket.flat.zero_()
            for p, view in zip((self.params[i] for i in bucket.params), bucket.views, strict=True):
                p.grad = view

    def zero_grad(self) -> None:
        for bucket in self.buckets:
            if bucket.flat is not None:
                bucket.flat.zero_()

    def take_grad(self, i: int) -> bool:
        """Puts parameter i's gradient in its bucket: adopted (one-parameter
        bucket), copied (shared bucket) or zeroed (no gradient on this rank).
        Returns whether it had a gradient."""
        bucket, s = self.slot[i]
        view, p = bucket.views[s], self.params[i]
        g = p.grad
        if self._to_release:
            if bucket in self._to_release:
                self._to_release.remove(bucket)  # taken now: not to be released
            self._release_next()  # the buffer the next gradient will replace
        if view is None:  # released (see release_dropped): adopt or allocate
            if g is None or not _adoptable(g, p):
                g_new = torch.zeros_like(p, memory_format=torch.contiguous_format)
                if g is not None:
                    g_new.copy_(g)
                    p.grad = g_new
                has, g = g is not None, g_new
            else:
                has = True
            bucket.flat, bucket.views[0] = g.view(-1), g
            return has
        if g is None:
            view.zero_()  # unused here: this rank adds nothing
            return False
        if g.data_ptr() == view.data_ptr():
            return True
        if len(bucket.params) == 1 and not bucket.shards and _adoptable(g, p):
            bucket.flat = g.view(-1)
            bucket.views[0] = g
        else:
            view.copy_(g)
            p.grad = view
        return True

    def release_dropped(self) -> None:
        """Plans to let go of the buffers of one-parameter buckets whose
        gradient the user dropped (``zero_grad(set_to_none=True)``), one at a
        time, just before autograd allocates the gradient that replaces it.

        Holding on to them would keep last step's gradients alive while
        autograd allocates this step's, so every step would fault in fresh
        pages (measured: 11 ms per 16 MiB gradient here, more than its
        all-reduce). Freeing them all at once is little better: malloc hands
        a large free block at the top of the heap back to the system, and the
        next allocations fault again. Freed one by one, in the order the
        gradients come (launch order), each block is reused by the next
        gradient's allocation. ``take_grad`` adopts the new gradient."""
        self._to_release = [
            b
            for b in self.buckets
            if len(b.params) == 1
            and not b.shards
            and b.flat is not None
            and self.params[b.params[0]].grad is None
        ]
        self._release_next()

    def _release_next(self) -> None:
        while self._to_release:
            bucket = self._to_release.pop(0)
            if bucket.flat is not None and self.params[bucket.params[0]].grad is None:
                bucket.flat = None
                bucket.views[0] = None
                return

    def grad_bytes(self) -> int:
        """The bytes of the gradients held now: full buffers, parts, the
        gradients autograd holds outside any buffer, and (ZeRO-3) the full
        buffers handed to a collective that has not finished with them."""
        self._in_flight = [(done, flat) for done, flat in self._in_flight if not done()]
        held = [t for b in self.buckets for t in (b.flat, b.shard_grad, b.scratch)]
        held += [self.params[i].grad for b in self.buckets if b.flat is None for i in b.params]
        held += [flat for _, flat in self._in_flight]
        return sum(t.numel() * t.element_size() for t in held if t is not None)

    def _note_peak(self) -> None:
        self._peak = max(self._peak, self.grad_bytes())

    def _collect(self, b: GradBucket) -> None:
        """ZeRO-2 and 3: bucket ``b``'s full buffer, made from its
        parameters' gradients (autograd's own tensors, or views of a buffer
        of the old bucket layout, until its launch), which go."""
        b.allocate()
        for i, view in zip(b.params, b.views, strict=True):
            g = self.params[i].grad
            if g is not None:
                view.copy_(g)
        self._note_peak()
        for i in b.params:
            self.params[i].grad = None

    def _hand_off(self, b: GradBucket, done) -> None:
        """ZeRO-3: ``b``'s full buffer belongs to its reduce-scatter from now
        on, and goes when ``done()`` (the buffer is released here; the
        collective keeps the tensor alive)."""
        self._in_flight.append((done, b.flat))
        b.release()

    def _allocate_full(self) -> None:
        """ZeRO-2: the sharded buckets' full buffers back (zeroed), each
        parameter's gradient a view of its bucket."""
        for b in self.buckets:
            if b.shards and b.flat is None:
                b.allocate()
                for i, view in zip(b.params, b.views, strict=True):
                    self.params[i].grad = view

    def _release_full(self, scratch: bool = True) -> None:
        """ZeRO-2, once their parts are in: the full buffers go (and, at the
        step's end, the scratch parts of later accumulation rounds)."""
        for b in self.buckets:
            if b.shards:
                b.release()
                if scratch:
                    b.scratch = None
                for i in b.params:
                    self.params[i].grad = None


def _adoptable(g: torch.Tensor, p: torch.Tensor) -> bool:
    """Whether gradient ``g`` can serve as its bucket's buffer as it is."""
    return g.is_contiguous() and g.dtype == p.dtype and g.device == p.device and g.shape == p.shape


def holds_storage(t: torch.Tensor) -> bool:
    """Whether a buffer holds storage (ZeRO-3 frees its parameters' between uses)."""
    return t.untyped_storage().nbytes() > 0


def free_storage(t: torch.Tensor) -> None:
    """Lets go of a tensor's storage, keeping the tensor (and the views of
    it, such as parameters) to be given storage again (``restore_storage``)."""
    t.untyped_storage().resize_(0)


def restore_storage(t: torch.Tensor) -> None:
    """Gives a freed tensor its storage back (uninitialised)."""
    if not holds_storage(t):
        t.untyped_storage().resize_(t.numel() * t.element_size())
