"""GossipConfig: parts that check themselves, keywords and config merged in one place, at every door."""

from __future__ import annotations

import typing
from datetime import timedelta

import pytest
import torch

from decent_optim_wrapper import (
    ClippedGossip,
    DecentOptimWrapper,
    DecentralizedDataParallel,
    GossipConfig,
    GossipEngine,
    Pacing,
    Robustness,
    Rounds,
    Transport,
)
from decent_optim_wrapper.engine.config import GossipOptions, KeywordOptions, PositionalOptions
from decent_optim_wrapper.engine.option_docs import OPTION_DOCS

pytestmark = pytest.mark.pure


def test_the_keywords_are_the_parts_fields_and_each_is_documented_once() -> None:
    keywords = GossipConfig.keywords()
    assert len(keywords) == len(set(keywords)) == 20
    assert set(typing.get_type_hints(GossipOptions)) == set(keywords)
    assert set(PositionalOptions.__annotations__).isdisjoint(KeywordOptions.__annotations__)
    assert list(OPTION_DOCS) == list(keywords)
    assert set(GossipConfig().options()) == set(keywords)


@pytest.mark.parametrize("door", [GossipEngine, DecentOptimWrapper, DecentralizedDataParallel])
def test_every_door_carries_each_options_text(door: type) -> None:
    doc = " ".join((door.__doc__ or "").split())
    for name, text in OPTION_DOCS.items():
        if door is DecentralizedDataParallel and name in ("rank", "world_size"):
            continue
        assert " ".join(text.split()) in doc, f"{door.__name__} does not describe {name}"
    assert "{gossip_options}" not in doc


def test_keywords_build_the_config_part_by_part() -> None:
    config = GossipConfig.from_options(sync_every=4, bucket_cap_mb=2, topology="complete")
    assert config.rounds == Rounds(sync_every=4)
    assert config.transport == Transport(bucket_cap_mb=2)
    assert config.topology == "complete"
    assert config.with_options(sync_every=1) == GossipConfig(
        topology="complete", transport=Transport(bucket_cap_mb=2)
    )
    assert GossipConfig.from_options(**config.options()) == config


def test_what_ranks_agree_on_is_read_from_the_fields_each_as_what_its_spellings_stand_for() -> None:
    # The fields marked agreed, in documentation order; clipped_gossip=True stands for ClippedGossip().
    config = GossipConfig.from_options(clipped_gossip=True, gradient_tracking=True, second_moment="local")
    assert config.agreed() == (
        ("gradient_tracking", True),
        ("clipped_gossip", ClippedGossip()),
        ("second_moment", "local"),
    )
    assert GossipConfig().agreed() == (
        ("gradient_tracking", False),
        ("clipped_gossip", None),
        ("second_moment", "average"),
    )
    # the rule the engine hands every round: clipped gossip's options, or None (plain differences)
    assert Robustness(clipped_gossip=True).mix_rule() == ClippedGossip()
    assert Robustness().mix_rule() is None and Robustness(clipped_gossip=False).mix_rule() is None


def test_a_keyword_that_agrees_with_the_config_is_accepted_one_that_contradicts_it_is_named() -> None:
    config = GossipConfig(rounds=Rounds(sync_every=4, pacing="measured"))
    assert GossipConfig.merge(config, {"sync_every": 4, "pacing": Pacing()}) is config  # the same request
    with pytest.raises(ValueError, match=r"sync_every=2 contradicts config=.*sync_every=4.*with_options"):
        GossipConfig.merge(config, {"sync_every": 2})


def test_an_unknown_keyword_names_the_close_one() -> None:
    with pytest.raises(
        TypeError, match=r"unexpected keyword argument 'sync_evry'.*did you mean 'sync_every'"
    ):
        GossipConfig.merge(None, {"sync_evry": 2})


@pytest.mark.parametrize(
    ("build", "fragments"),
    [
        (lambda: Transport(bucket_cap_mb=0), ["bucket_cap_mb", "0", "e.g. 25"]),
        (lambda: Transport(timeout=5), ["timeout", "5", "timedelta(minutes=5)"]),
        (lambda: Transport(compression="int9"), ["compression='int9'", "pass one of"]),
        (lambda: Rounds(sync_every=0), ["sync_every", "0", "e.g. 8"]),
        (lambda: Rounds(sync_every=4, gradient_tracking=True), ["gradient_tracking=True", "sync_every=4"]),
        (lambda: GossipConfig(second_moment="mean"), ["second_moment", "'mean'", "'average'"]),
        (lambda: GossipConfig(rounds=4), ["GossipConfig(rounds=...)", "Rounds(...)"]),
        (
            lambda: GossipConfig.from_options(on_peer_failure="retry"),
            ["on_peer_failure", "'retry'", '"continue"'],
        ),
        (lambda: GossipConfig.from_options(timeout=timedelta(0)), ["timeout must be positive"]),
    ],
)
def test_each_part_checks_itself_with_the_options_message(build, fragments) -> None:
    with pytest.raises((TypeError, ValueError)) as error:
        build()
    for fragment in fragments:
        assert fragment in str(error.value), (fragment, str(error.value))


def test_a_bad_option_before_any_process_group_is_raised_as_it_is() -> None:
    model = torch.nn.Linear(2, 2)
    with pytest.raises(TypeError, match="bucket_cap_mb must be a number"):
        DecentOptimWrapper(torch.optim.SGD(model.parameters(), lr=0.1), bucket_cap_mb="big")
