"""load_config / PadfreeConfig: defaults, strict validation with suggestions, YAML errors naming the file."""

from __future__ import annotations

import dataclasses
import textwrap
from pathlib import Path

import pytest

from padfree_plugins.config.schema import PadfreeConfig, PluginsConfig, describe_fields, load_config
from padfree_plugins.errors import ConfigError

REPO_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "padfree.yaml"


def write(tmp_path: Path, text: str, name: str = "padfree.yaml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def config_error(data) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(data)
    return str(info.value)


# -- defaults and sources -------------------------------------------------------------------------------------------


def test_defaults():
    config = load_config(None)
    assert config == PadfreeConfig()
    assert config.task == "causal_lm"
    assert config.attention == "auto" and config.architecture == "auto"
    assert config.max_length is None and config.on_overlong == "error"
    assert config.pooling is None and config.task_options == {}
    assert config.plugins == PluginsConfig(require=[], block=[])


def test_defaults_are_not_shared_between_instances():
    a, b = PadfreeConfig(), PadfreeConfig()
    a.plugins.require.append("x")
    a.task_options["k"] = 1
    assert b.plugins.require == [] and b.task_options == {}


def test_empty_dict_and_empty_file_give_defaults(tmp_path):
    assert load_config({}) == PadfreeConfig()
    assert load_config(write(tmp_path, "")) == PadfreeConfig()
    assert load_config(write(tmp_path, "# only a comment\n", "c.yaml")) == PadfreeConfig()


def test_existing_config_is_returned_as_is():
    config = PadfreeConfig(task="hidden_states")
    assert load_config(config) is config


def test_full_config_from_yaml(tmp_path):
    path = write(tmp_path, """
        task: hidden_states
        attention: exact
        architecture: llama
        max_length: 512
        on_overlong: truncate
        pooling: mean
        task_options:
          temperature: 0.05
          nested: {a: 1}
        plugins:
          require: [llama, core]
          block: [flash]
    """)
    expected = PadfreeConfig(task="hidden_states", attention="exact", architecture="llama", max_length=512,
                             on_overlong="truncate", pooling="mean",
                             task_options={"temperature": 0.05, "nested": {"a": 1}},
                             plugins=PluginsConfig(require=["llama", "core"], block=["flash"]))
    assert load_config(path) == expected
    assert load_config(str(path)) == expected
    assert load_config(expected.to_dict()) == expected


def test_to_dict_round_trips():
    config = PadfreeConfig(max_length=8, plugins=PluginsConfig(block=["x"]))
    data = config.to_dict()
    assert data["plugins"] == {"require": [], "block": ["x"]}
    assert PadfreeConfig.from_dict(data) == config
    assert PadfreeConfig.from_dict(None) == PadfreeConfig()


def test_empty_sections_mean_defaults(tmp_path):
    path = write(tmp_path, """
        task_options:
        plugins:
          # require: [llama]
    """)
    config = load_config(path)
    assert config.plugins == PluginsConfig() and config.task_options == {}


def test_explicit_nulls_for_optional_values():
    config = load_config({"max_length": None, "pooling": None})
    assert config.max_length is None and config.pooling is None


def test_repo_config_loads():
    if not REPO_CONFIG.exists():
        pytest.skip("configs/padfree.yaml is not there yet")
    config = load_config(REPO_CONFIG)
    assert isinstance(config, PadfreeConfig)
    assert config.task and config.attention and config.on_overlong in ("error", "truncate")


# -- unknown keys ---------------------------------------------------------------------------------------------------


def test_unknown_top_level_key_suggests_nearest(tmp_path):
    message = config_error(write(tmp_path, "atention: exact\n"))
    assert "unknown key 'atention'" in message
    assert "Did you mean 'attention'?" in message
    assert "padfree.yaml" in message  # names the file
    for key in ("task", "attention", "max_length", "plugins"):
        assert key in message.split("Valid keys:")[1]


def test_unknown_key_without_close_match_lists_valid_keys():
    message = config_error({"zzzzzz": 1})
    assert "unknown key 'zzzzzz'" in message and "Did you mean" not in message and "Valid keys:" in message


def test_unknown_nested_key_suggests_nearest(tmp_path):
    message = config_error(write(tmp_path, "plugins:\n  requre: [llama]\n"))
    assert "plugins" in message and "unknown key 'requre'" in message
    assert "Did you mean 'require'?" in message
    assert "Valid keys: require, block." in message


@pytest.mark.parametrize(
    ("data", "fragments"),
    [
        ({"max_length": "ten"}, ["max_length must be int | null", "'ten'"]),
        ({"max_length": True}, ["max_length must be int | null", "True"]),
        ({"max_length": 2.5}, ["max_length must be int | null", "2.5"]),
        ({"max_length": 0}, ["max_length must be at least 1", "got 0"]),
        ({"max_length": -5}, ["max_length must be at least 1", "got -5"]),
        ({"on_overlong": "trunc"}, ["on_overlong must be one of 'error', 'truncate'", "'trunc'",
                                    "Did you mean 'truncate'?"]),
        ({"on_overlong": True}, ["on_overlong must be one of"]),
        ({"plugins": {"require": "llama"}}, ["plugins: require must be a list", "'llama'"]),
        ({"plugins": {"block": [1]}}, ["plugins: block[0] must be a non-empty string"]),
        ({"plugins": {"require": ["llama", ""]}}, ["require[1] must be a non-empty string"]),
        ({"plugins": ["llama"]}, ["plugins: expected a mapping", "list"]),
        ({"task": ""}, ["task must be a non-empty string", "''"]),
        ({"task": "   "}, ["task must be a non-empty string"]),
        ({"task": 3}, ["task must be a non-empty string", "3"]),
        ({"attention": None}, ["attention must be a non-empty string", "None"]),
        ({"pooling": 1}, ["pooling must be str | null"]),
        ({"task_options": [1, 2]}, ["task_options must be a mapping"]),
    ],
)
def test_wrong_types(data, fragments):
    message = config_error(data)
    for fragment in fragments:
        assert fragment in message, (fragment, message)


def test_wrong_type_in_file_names_file_and_key(tmp_path):
    path = write(tmp_path, "max_length: ten\n", "bad.yaml")
    message = config_error(path)
    assert str(path) in message and "max_length" in message and "'ten'" in message


def test_config_error_is_a_value_error():
    with pytest.raises(ValueError):
        load_config({"max_length": "ten"})


# -- files ----------------------------------------------------------------------------------------------------------


def test_invalid_yaml_names_the_file(tmp_path):
    path = write(tmp_path, "task: [unclosed\nattention: auto\n", "broken.yaml")
    message = config_error(path)
    assert str(path) in message and "not valid YAML" in message


def test_tab_indentation_is_invalid_yaml(tmp_path):
    path = write(tmp_path, "plugins:\n\trequire: []\n", "tabs.yaml")
    assert "not valid YAML" in config_error(path)


@pytest.mark.parametrize(("text", "kind"), [("- task\n- attention\n", "list"), ("just a string\n", "str"),
                                             ("42\n", "int")])
def test_top_level_must_be_a_mapping(tmp_path, text, kind):
    path = write(tmp_path, text)
    message = config_error(path)
    assert str(path) in message and "top level must be a mapping" in message and kind in message


def test_missing_file(tmp_path):
    path = tmp_path / "nope.yaml"
    message = config_error(path)
    assert "does not exist" in message and "nope.yaml" in message
    assert "does not exist" in config_error(str(path))


def test_directory_is_not_a_config(tmp_path):
    assert "is a directory" in config_error(tmp_path)


def test_not_a_path_nor_a_mapping():
    assert "a YAML path, a dict or a PadfreeConfig, not int" in config_error(42)


def test_a_key_given_twice_is_an_error(tmp_path):
    path = tmp_path / "twice.yaml"
    path.write_text("task: causal_lm\nattention: exact\ntask: seq_cls\n")
    assert "key 'task' is given twice" in config_error(path)


def test_a_file_that_is_not_utf8_is_named(tmp_path):
    path = tmp_path / "latin1.yaml"
    path.write_bytes("task: caus\u00e9\n".encode("latin-1"))
    message = config_error(path)
    assert "latin1.yaml" in message and "not UTF-8" in message


def test_a_token_budget_needs_its_size():
    message = config_error({"batching": {"strategy": "tokens"}})
    assert "max_tokens_per_batch is not set" in message


# -- field descriptions ---------------------------------------------------------------------------------------------


def test_describe_fields_lists_every_key_with_help():
    rows = describe_fields()
    keys = [key for key, _, _ in rows]
    sections = {f.name: f.default_factory for f in dataclasses.fields(PadfreeConfig)
                if dataclasses.is_dataclass(f.default_factory)}
    assert sections["plugins"] is PluginsConfig
    expected = [f.name for f in dataclasses.fields(PadfreeConfig) if f.name not in sections]
    expected += [f"{name}.{f.name}" for name, cls in sections.items() for f in dataclasses.fields(cls)]
    assert sorted(keys) == sorted(expected)
    assert len(keys) == len(set(keys))
    for key, type_name, help_text in rows:
        assert type_name, key
        assert help_text and len(help_text) > 10, key
    types = {key: type_name for key, type_name, _ in rows}
    assert types["max_length"] == "int | null"
    assert types["on_overlong"] == "'error' | 'truncate'"
    assert types["plugins.require"] == "list[str]"
    assert types["task"] == "str"


def test_every_described_key_is_accepted():
    """Each key describe_fields reports can be set in a config (docs and loader agree)."""
    samples = {"int | null": 4, "str": "x", "str | null": "mean", "'error' | 'truncate'": "truncate",
               "list[str]": ["a"], "int": 4, "bool": True, "int | 'auto' | null": 4}
    for key, type_name, _ in describe_fields():
        literal = type_name.split(" | ")[-1].strip("'") if type_name.startswith("'") else None
        value = samples.get(type_name, literal if literal is not None else {})
        data: dict = {}
        *parents, leaf = key.split(".")
        node = data
        for parent in parents:
            node = node.setdefault(parent, {})
        node[leaf] = value
        if key == "batching.strategy":
            node["max_tokens_per_batch"] = 4  # required with strategy: tokens
        if key in ("batching.max_tokens_per_batch", "batching.max_pixels_per_batch"):
            node["strategy"] = "tokens"  # a budget is an error under strategy: examples, which ignores it
            node.setdefault("max_tokens_per_batch", 4)
        if key == "memory.loss_kernel":
            node["tile_tokens"] = 4  # loss_kernel: liger is an error without the tiled loss
        config = load_config(data)
        target = config
        for part in key.split("."):
            target = getattr(target, part)
        assert target == value, key


# -- what check sees: the plugins' own reading of the config -------------------------------------------------------


@pytest.mark.parametrize("config, message", [
    ({"task_options": {"labels_from_ids": True}}, "Did you mean 'labels_from_input_ids'"),
    ({"task": "hidden_states", "task_options": {"anything": 1}}, "not an option of task 'hidden_states'"),
    ({"task": "embedding", "pooling": "avg", "task_options": {"loss": "CoSENTLoss"}}, "pooling mode 'avg'"),
    ({"task": "embedding", "task_options": {"normalize": "yes"}}, "normalize of task 'embedding' must be true"),
    ({"task": "seq_cls", "pooling": "mean"}, "not used by task 'seq_cls'"),
])
def test_plan_checks_what_the_task_plugins_read(config, message):
    """``plan`` (and so ``padfree-plugins check``) refuses what assembly would: task options, pooling modes."""
    from padfree_plugins import plan
    from tests.conftest import tiny_config

    with pytest.raises(ConfigError, match=message):
        plan(tiny_config("llama"), config, device_type="cpu")


def test_blocking_a_plugin_that_is_not_installed_is_a_note():
    from padfree_plugins import plan
    from tests.conftest import tiny_config

    notes = plan(tiny_config("llama"), {"plugins": {"block": ["lama"]}}, device_type="cpu").notes
    assert any("plugins.block names 'lama', which is not installed. Did you mean 'llama'" in note for note in notes)


# -- words YAML 1.1 reads as booleans -------------------------------------------------------------------------------


def yaml_line(key: str, value: str) -> str:
    """``key: value`` as padfree.yaml writes it, a dotted key nested in its section."""
    *sections, name = key.split(".")
    lines = [f"{'  ' * depth}{section}:" for depth, section in enumerate(sections)]
    if key == "batching.strategy" and value.strip("'") == "tokens":  # a budget is needed beside it
        lines.append("  max_tokens_per_batch: 64")
    if key == "memory.loss_kernel" and value.strip("'") == "liger":  # the tiled loss is needed beside it
        lines.append("  tile_tokens: 64")
    return "\n".join([*lines, f"{'  ' * len(sections)}{name}: {value}"]) + "\n"


def value_of(config: PadfreeConfig, key: str):
    for part in key.split("."):
        config = getattr(config, part)
    return config


BARE_BOOLEANS = {"on": True, "yes": True, "true": True, "On": True, "off": False, "no": False, "false": False,
                 "OFF": False}
CHOICES = [(key, kind) for key, kind, _ in describe_fields() if kind.startswith("'")]


def test_every_choice_option_is_covered():
    assert {key for key, _ in CHOICES} >= {"prefix_sharing", "unpad", "mixers", "attention_dropout", "on_overlong",
                                           "batching.strategy", "batching.on_overlong_example"}


@pytest.mark.parametrize("key, kind", CHOICES, ids=[key for key, _ in CHOICES])
def test_every_choice_written_bare_in_yaml_loads_or_says_quote_it(tmp_path, key, kind):
    """Every allowed value of every option with fixed choices, written bare in a YAML file: it loads as written, or
    (where YAML 1.1 reads the word as a boolean and the option has no on / off) the error says to quote it; quoted,
    it always loads. A bare word YAML reads as a boolean loads as on / off where the option has them."""
    allowed = [choice.strip("'") for choice in kind.split(" | ")]
    for word in allowed:
        assert value_of(load_config(write(tmp_path, yaml_line(key, f"'{word}'"))), key) == word
        path = write(tmp_path, yaml_line(key, word))
        if word.lower() not in BARE_BOOLEANS or word in ("on", "off"):
            assert value_of(load_config(path), key) == word, (key, word)
        else:
            assert "write the word you meant in quotes" in config_error(path)
    for bare, truth in BARE_BOOLEANS.items():
        path = write(tmp_path, yaml_line(key, bare))
        meant = "on" if truth else "off"
        if meant in allowed:
            assert value_of(load_config(path), key) == meant, (key, bare)
        else:
            message = config_error(path)
            assert f"got {truth}" in message and "write the word you meant in quotes" in message, message


def test_prefix_sharing_written_bare_as_documented():
    """The documented ``prefix_sharing: on`` (YAML 1.1 reads it as true) and its booleans: on / off."""
    for text, want in (("prefix_sharing: on\n", "on"), ("prefix_sharing: off\n", "off"),
                       ("prefix_sharing: true\n", "on"), ("prefix_sharing: no\n", "off")):
        assert load_config(PadfreeConfig.from_dict(__import__("yaml").safe_load(text))).prefix_sharing == want
    assert load_config({"prefix_sharing": True}).prefix_sharing == "on"
    assert load_config({"unpad": False}).unpad == "off"


@pytest.mark.parametrize("text, fragments", [
    ("unpad: on\n", ["unpad must be one of 'auto', 'always', 'off', got True", "boolean", "in quotes"]),
    ("mixers: no\n", ["mixers must be one of 'auto', 'exact', 'kernels', got False", "in quotes"]),
    ("attention: off\n", ["attention must be a non-empty string, got False", "in quotes"]),
    ("task: yes\n", ["task must be a non-empty string, got True", "in quotes"]),
    ("pooling: off\n", ["pooling must be str | null, got False", "in quotes"]),
    ("pooling: 1\n", ["pooling must be str | null, got 1", "as a number", "('1')"]),
    ("plugins:\n  block: [no]\n", ["block[0] must be a non-empty string, got False", "in quotes"]),
])
def test_a_bare_word_read_as_a_boolean_or_number_where_text_is_meant_says_quote_it(tmp_path, text, fragments):
    message = config_error(write(tmp_path, text))
    for fragment in fragments:
        assert fragment in message, (fragment, message)


def test_numbers_and_booleans_where_no_text_is_meant_do_not_say_quote_it():
    for data in ({"max_length": True}, {"max_length": 2.5}, {"batching": {"drop_last": "yes"}}):
        assert "quotes" not in config_error(data)


def test_task_options_written_bare_say_quote_it():
    from padfree_plugins.config.task_options import read_options

    with pytest.raises(ConfigError, match="objective of task 'reranker' must be one of.*got False.*in quotes"):
        read_options("reranker", {"objective": False}, {"objective": None}, {"objective": ("pointwise",)})
    with pytest.raises(ConfigError, match="name of task 't' must be a string, got True.*in quotes"):
        read_options("t", {"name": True}, {"name": "x"})
    with pytest.raises(ConfigError, match="flag of task 't' must be true or false, got 'no'.$"):
        read_options("t", {"flag": "no"}, {"flag": False})
