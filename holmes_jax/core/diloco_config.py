"""The ``diloco`` section of a run's config: DiLoCo across islands, in one program or as
independent jobs (documented like every section: :mod:`holmes_jax.core.sections`)."""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass
from typing import Literal

from holmes_jax.core.errors import ConfigError
from holmes_jax.core.keyfile import read_key
from holmes_jax.core.sections import ModelConfig, ParallelConfig, _positive
from holmes_jax.core.spec import (
    SPARSE_BITS,
    SPARSE_CHUNK_MAX,
    SPARSE_CHUNK_MIN,
    STEPS,
    DilocoEnabled,
    OuterDtypeChoice,
)

# spmd: one jax job, islands are the replica axis; independent: one job per island, the outer
# sync between jobs over the host-level protocol (holmes_jax.diloco.sync).
DilocoMode = Literal["spmd", "independent"]


def is_loopback(host: str) -> bool:
    """Whether ``host`` names this machine only: ``localhost``, ``127.0.0.0/8`` or ``::1``."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class DilocoConfig:
    """DiLoCo across the ``replica`` axis (one replica per island or group of islands).

    Each replica takes ``inner_steps`` AdamW steps on its own; then the replicas average
    their parameter deltas (the outer gradient, sent as ``outer_dtype``) and apply an
    outer Nesterov-momentum SGD step to the last global parameters. With ``fragments`` > 1
    (streaming DiLoCo) the layers are cut into that many fragments, each synchronised on
    its own step offset inside the H steps, so the peak cross-island volume drops by that
    factor. ``enabled: auto`` lets the planner choose DiLoCo only when its predicted
    speedup over the best synchronous plan is at least ``auto_min_speedup``. With
    ``warmup_steps`` = K the first K steps each end with plain averaging of the replicas
    (the DiLoCo paper starts from a synchronously trained model; averaging every step is
    the nearest thing across a slow link), and the H-step rounds start after step K.
    """

    enabled: DilocoEnabled = False  # DiLoCo on, off, or auto (the planner decides)
    inner_steps: int = 50  # H: inner steps per outer step
    outer_lr: float = 0.7  # learning rate of the outer Nesterov SGD
    outer_momentum: float = 0.9  # Nesterov momentum of the outer SGD
    fragments: int = 1  # streaming DiLoCo above 1; at most inner_steps and num_layers
    # what crosses the link (the outer state stays fp32); auto: the planner picks the
    # smallest format the link needs (planner.outer_formats says the rule)
    outer_dtype: OuterDtypeChoice = "fp32"
    # outer_dtype sparse (independent): the delta is cut into chunks of this many values (a
    # power of two, 16..32768); what a chunk does not send is kept and added to the next
    # round's delta (error feedback)
    sparse_chunk: int = 4096
    # outer_dtype sparse: the values each chunk sends, its largest. The default (with 4 bits)
    # is the smallest measured within 1% of fp32 (8x); 64 with 2 bits sends 139x fewer bytes
    sparse_k: int = 1024
    # outer_dtype sparse: bits per value sent (2, 4, 8; 32 sends fp32), one scale a chunk
    sparse_bits: int = 4
    auto_min_speedup: float = 1.5  # enabled=auto picks DiLoCo only at this predicted speedup
    # K: the first K steps each end with plain averaging of the replicas (every fragment,
    # outer lr 1, momentum untouched); then rounds of H steps.
    warmup_steps: int = 0
    # spmd: one job, islands are replicas; independent: one job per island
    mode: DilocoMode = "spmd"
    # independent: an island whose round delta is not in within this many seconds is
    # dropped from that outer step (the others average among themselves and go on)
    quorum_timeout_s: float = 60.0
    # independent: a round's leader waits this many seconds (from the round's first delta)
    # for members whose outer-sync port refuses connections: their process is down
    # (restarting, or gone). 0: not at all, they take the round's result when back; at
    # least diloco.quorum_timeout_s: as long as for a silent member
    down_wait_s: float = 0.0
    # independent: this job's island, an index into diloco.peers (and parallel.mesh's
    # islands); `launch --independent-islands` sets it
    island: int = -1
    # independent: every island's outer-sync addresses, by island index: "host:port", or
    # one per lane joined by commas, the same count for every island (lane l of each
    # island exchanges block l of every parameter; an island's processes split its lanes)
    peers: tuple[str, ...] = ()
    # independent: after the warm-up, each outer sync runs in the background during the next
    # overlap_steps inner steps, then merges (global + the progress since); 0 = in step
    overlap_steps: int = 0
    # independent: a file holding the key every island shares (>= 16 bytes); each request
    # and reply between islands is then authenticated (HMAC-SHA256). Required when a peer
    # is off loopback, unless diloco.insecure; launch --independent-islands makes one
    sync_key_file: str | None = None
    # independent: let peers off loopback talk without diloco.sync_key_file (anyone who
    # reaches an island's port can then send it deltas)
    insecure: bool = False
    # independent: TLS for the outer sync: this island's certificate (PEM); unset = plain HTTP
    tls_cert: str | None = None
    tls_key: str | None = None  # independent, with tls_cert: the certificate's private key (PEM)
    # independent, with tls_cert: the CA that signed the peers' certificates (then both sides
    # present one: mutual TLS); unset = the system's CAs
    tls_ca: str | None = None
    # independent, fault injection for tests: the round after each of these steps' inner
    # steps, this island sends nothing and takes the global model, as after a non-finite
    # step; launch --fail-host HOST@STEP:abstain sets it for the island holding HOST
    inject_abstain_steps: tuple[int, ...] = ()

    def validate(self, model: ModelConfig, parallel: ParallelConfig) -> None:
        _positive(self, "diloco", ("inner_steps", "fragments"))
        if self.inject_abstain_steps and self.mode != "independent":
            raise ConfigError(
                f"diloco.inject_abstain_steps={list(self.inject_abstain_steps)}: needs "
                "diloco.mode=independent (an island abstains from the outer sync's rounds)"
            )
        for step in self.inject_abstain_steps:
            if not 1 <= step <= STEPS.limit:
                raise ConfigError(
                    f"diloco.inject_abstain_steps={list(self.inject_abstain_steps)}: step "
                    f"{step} must be >= 1 and <= {STEPS.text} (steps count from 1, as logged)"
                )
        if self.quorum_timeout_s <= 0:
            raise ConfigError(f"diloco.quorum_timeout_s={self.quorum_timeout_s}: must be > 0")
        if self.down_wait_s < 0:
            raise ConfigError(f"diloco.down_wait_s={self.down_wait_s}: must be >= 0")
        gap = self.round_gap()
        if not 0 <= self.overlap_steps < gap:
            between = f"diloco.inner_steps={self.inner_steps}"
            if gap != self.inner_steps:
                between = f"{gap}, the fewest steps between two fragments' rounds"
            raise ConfigError(
                f"diloco.overlap_steps={self.overlap_steps}: must be in [0, {between}) (a "
                "round merges before the next is sent; 0 = in step)"
            )
        self._validate_sparse()
        if self.mode == "independent":
            self._validate_independent()
        elif self.overlap_steps:
            raise ConfigError(
                f"diloco.overlap_steps={self.overlap_steps}: needs diloco.mode=independent "
                "(the spmd outer step is one collective inside the program)"
            )
        if self.outer_lr <= 0:
            raise ConfigError(f"diloco.outer_lr={self.outer_lr}: must be > 0")
        if not 0 <= self.outer_momentum < 1:
            raise ConfigError(f"diloco.outer_momentum={self.outer_momentum}: must be in [0, 1)")
        if self.warmup_steps < 0:
            raise ConfigError(
                f"diloco.warmup_steps={self.warmup_steps}: must be >= 0 (0 = no warm-up)"
            )
        if self.auto_min_speedup < 1:
            raise ConfigError(
                f"diloco.auto_min_speedup={self.auto_min_speedup}: must be >= 1 (a speedup)"
            )
        if self.fragments > self.inner_steps:
            raise ConfigError(
                f"diloco.fragments={self.fragments}: must be <= diloco.inner_steps="
                f"{self.inner_steps} (each fragment syncs on its own inner step)"
            )
        if self.fragments > model.num_layers:
            raise ConfigError(
                f"diloco.fragments={self.fragments}: must be <= model.num_layers="
                f"{model.num_layers} (a fragment holds whole layers)"
            )
        if (
            self.enabled is True
            and parallel.replica < 2
            and parallel.mesh is None
            and not self.peers
        ):
            raise ConfigError(
                f"diloco.enabled=true: needs parallel.replica >= 2 (got {parallel.replica}) "
                "or a parallel.mesh with several islands: DiLoCo runs across replicas"
            )

    def _validate_sparse(self) -> None:
        c, k, bits = self.sparse_chunk, self.sparse_k, self.sparse_bits
        if not (SPARSE_CHUNK_MIN <= c <= SPARSE_CHUNK_MAX and c & (c - 1) == 0):
            raise ConfigError(
                f"diloco.sparse_chunk={c}: must be a power of two in [{SPARSE_CHUNK_MIN}, "
                f"{SPARSE_CHUNK_MAX}] "
                "(positions travel in log2(chunk) bits)"
            )
        if not 1 <= k <= c:
            raise ConfigError(f"diloco.sparse_k={k}: must be in [1, diloco.sparse_chunk={c}]")
        if bits not in SPARSE_BITS:
            raise ConfigError(f"diloco.sparse_bits={bits}: must be one of {list(SPARSE_BITS)}")
        if self.outer_dtype == "sparse" and self.mode != "independent":
            raise ConfigError(
                "diloco.outer_dtype=sparse: needs diloco.mode=independent (the spmd outer "
                "step is one all-gather inside the program, in fp32, bf16 or int8)"
            )

    def round_gap(self) -> int:
        """The fewest inner steps between two rounds after the warm-up: H over F, rounded
        down at worst (fragment f syncs at offset ⌊f·H/F⌋ of each H)."""
        if not 0 < self.fragments <= self.inner_steps:
            return self.inner_steps
        h, f = self.inner_steps, self.fragments
        offsets = [i * h // f for i in range(f)] + [h]
        return min(b - a for a, b in zip(offsets, offsets[1:], strict=False))

    def _validate_independent(self) -> None:
        where = "(python -m holmes_jax.launch --independent-islands sets diloco.island/peers)"
        if self.enabled is not True:
            raise ConfigError(
                f"diloco.mode=independent: needs diloco.enabled=true (got {self.enabled}); "
                "independent islands are DiLoCo replicas in separate jobs"
            )
        if len(self.peers) < 2:
            raise ConfigError(
                f"diloco.peers={list(self.peers)}: diloco.mode=independent needs every "
                f"island's outer-sync address host:port, at least 2 {where}"
            )
        addresses = self.lane_addresses()
        self._validate_security(addresses)
        if not 0 <= self.island < len(self.peers):
            raise ConfigError(
                f"diloco.island={self.island}: must be this job's index into diloco.peers "
                f"(0..{len(self.peers) - 1}) {where}"
            )

    def _validate_security(self, addresses: list[list[tuple[str, int]]]) -> None:
        if self.sync_key_file is not None:
            try:
                read_key(self.sync_key_file)
            except (OSError, ValueError) as err:
                why = err.strerror if isinstance(err, OSError) else str(err)
                raise ConfigError(
                    f"diloco.sync_key_file={self.sync_key_file}: {why} (a file holding the "
                    "key every island shares; python -m holmes_jax.launch "
                    "--independent-islands makes one)"
                ) from None
        hosts = {host for lanes in addresses for host, _ in lanes}
        off = sorted(h for h in hosts if not is_loopback(h))
        if off and self.sync_key_file is None and not self.insecure:
            raise ConfigError(
                f"diloco.sync_key_file=None: peers off loopback ({', '.join(off[:3])}) need a "
                "shared key to authenticate the outer sync (or diloco.insecure=true to let "
                "anyone who reaches the ports send deltas)"
            )
        tls = {"tls_cert": self.tls_cert, "tls_key": self.tls_key, "tls_ca": self.tls_ca}
        if (self.tls_cert is None) != (self.tls_key is None) or (
            self.tls_ca is not None and self.tls_cert is None
        ):
            raise ConfigError(
                f"diloco.tls_cert={self.tls_cert}, diloco.tls_key={self.tls_key}: TLS needs "
                "both (and diloco.tls_ca only with them)"
            )
        for key, path in tls.items():
            if path is not None and not os.path.isfile(path):
                raise ConfigError(f"diloco.{key}={path}: no such file")

    def lane_addresses(self) -> list[list[tuple[str, int]]]:
        """``peers`` as each island's lane addresses ``(host, port)``.

        Raises:
          ConfigError: an address is malformed, or the islands list different lane counts.
        """
        out = []
        for i, entry in enumerate(self.peers):
            lanes = []
            for address in str(entry).split(","):
                host, _, port = address.strip().rpartition(":")
                if not host or not port.isdigit() or not 0 < int(port) < 65536:
                    raise ConfigError(
                        f"diloco.peers[{i}]={entry!r}: each address must be host:port with a "
                        "port in 1-65535 (several, one per lane, joined by commas)"
                    )
                lanes.append((host, int(port)))
            out.append(lanes)
        if len({len(lanes) for lanes in out}) > 1:
            listed = ", ".join(f"island {i}: {len(lanes)}" for i, lanes in enumerate(out))
            raise ConfigError(
                f"diloco.peers={list(self.peers)}: every island must list the same number of "
                f"lane addresses ({listed}); lane l of each island exchanges block l of "
                "every parameter"
            )
        return out
