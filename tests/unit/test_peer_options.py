"""``pccl.peer.options.PeerOptions``: a Communicator's settings, checked once and frozen;
the Communicator's attributes read them."""

from __future__ import annotations

import dataclasses
import inspect

import pytest

import pccl
from pccl.peer.options import PeerOptions


def test_the_options_are_frozen() -> None:
    opts = PeerOptions(master="127.0.0.1:1", timeout=3.0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        opts.timeout = 4.0  # type: ignore[misc]
    assert opts.timeout == 3.0


def test_a_bad_value_raises_the_constructors_error_and_replace_checks_it_too() -> None:
    with pytest.raises(pccl.InvalidArgumentError,
                       match=r"piece_bytes must be an integer in 1..1073741824, got 0"):
        PeerOptions(piece_bytes=0)
    with pytest.raises(pccl.InvalidArgumentError, match=r"piece_bytes .* got 0"):
        pccl.Communicator("127.0.0.1:1", piece_bytes=0)
    opts = PeerOptions()
    with pytest.raises(pccl.InvalidArgumentError, match=r"via_master_max_bytes .* got -1"):
        dataclasses.replace(opts, via_master_max_bytes=-1)
    # ``masters`` is made from ``master``, never given.
    with pytest.raises(ValueError, match="init=False"):
        dataclasses.replace(opts, masters=("a:1",))
    assert dataclasses.replace(opts, master="a:1,b:2").masters == ("a:1", "b:2")


def test_masters_is_derived_and_a_list_is_kept_as_a_tuple() -> None:
    opts = PeerOptions(master=["a:1", "b:2"])
    assert (opts.master, opts.masters) == (("a:1", "b:2"), ("a:1", "b:2"))
    assert PeerOptions(collective_timeout=5).collective_timeout == 5.0
    assert "metrics_token" not in repr(PeerOptions(metrics_token="hush"))


def test_the_communicator_reads_its_options_and_takes_their_defaults() -> None:
    params = inspect.signature(pccl.Communicator).parameters
    live = {"secret", "key_file", "cert_file", "trust"}  # live state, not options
    fields = {f.name: f.default for f in dataclasses.fields(PeerOptions) if f.init}
    assert set(params) - live == set(fields)
    assert {p: params[p].default for p in fields} == fields

    comm = pccl.Communicator("127.0.0.1:1", peer_group=2, timeout=3.0, name="n1")
    assert comm.options == PeerOptions(master="127.0.0.1:1", peer_group=2, timeout=3.0,
                                       name="n1")
    for f in dataclasses.fields(PeerOptions):
        assert getattr(comm, f.name) == getattr(comm.options, f.name), f.name
    with pytest.raises(AttributeError, match=r"Communicator.timeout is read-only"):
        comm.timeout = 4.0  # type: ignore[misc]
    comm.options = dataclasses.replace(comm.options, timeout=4.0)
    assert comm.timeout == 4.0
