"""The launcher's flags for what is trained: the model, its data, optimizer and precision,
and the checks across them (run before any work; no TensorFlow runtime is started).
"""

from __future__ import annotations

from typing import Any

from absl import flags

from hybrid.run.data_sources import is_function_spec

__all__ = ["KERAS_OPTIMIZERS", "define_flags", "register_late_validators"]


def define_flags() -> None:
    """Defines the model, data, optimizer and precision flags and their validators (the
    ones that read --mesh and --keras_file run after every flag is defined)."""
    _define_model_flags()
    flags.register_multi_flags_validator(
        ["model", "data", "width", "num_heads"], _check_model_and_data
    )
    flags.register_multi_flags_validator(["optimizer", "optimizer_config"], _check_optimizer)
    flags.register_multi_flags_validator(
        ["data", "tfrecord_features", "tfrecord_label"], _check_tfrecord
    )
    flags.register_multi_flags_validator(
        ["model", "validation_data", "validation_steps", "tfrecord_features"], _check_validation
    )


def register_late_validators() -> None:
    """The validators that also read flags defined elsewhere (--mesh, --keras_file)."""
    flags.register_multi_flags_validator(["keras_file", "tie_embeddings"], _check_keras_file)


def _define_model_flags() -> None:
    from hybrid.models import catalog

    flags.DEFINE_string(
        "model",
        "transformer",
        f"A reference model ({', '.join(catalog.MODEL_NAMES)}) or yours: 'package.module:fn', "
        "fn() returning a Keras model, or a dict {'model': ..., 'loss': ..., 'metrics': ...}.",
    )
    flags.register_validator(
        "model",
        lambda value: value in catalog.MODEL_NAMES or is_function_spec(value),
        message=f"value should be one of {list(catalog.MODEL_NAMES)} or 'package.module:function'",
    )
    flags.DEFINE_string(
        "data",
        "text:python-docs",
        "'synthetic', 'text:PATH' (byte-level LM on a text file), 'text:python-docs' (the "
        "Python manual shipped with CPython), 'tfrecord:PATTERN' (tf.train.Example files, "
        "parsed by --tfrecord_features) or 'package.module:fn', fn(global_batch_size) "
        "returning a tf.data.Dataset of (x, y) global batches.",
    )
    flags.DEFINE_string(
        "tfrecord_features",
        None,
        '--data=tfrecord:...: the features as JSON, {"name": ["float32"|"int64"|"string", '
        "[shape]], ...}; --tfrecord_label names the label, the others are the inputs.",
    )
    flags.DEFINE_string("tfrecord_label", "label", "--data=tfrecord:...: the label feature.")
    flags.DEFINE_string(
        "validation_data",
        None,
        "Data to evaluate on at the end of the run, in --data's grammar (a reference source "
        "draws other batches: seed + 1); its losses and metrics are logged as val_*.",
    )
    flags.DEFINE_integer(
        "validation_steps",
        None,
        "--validation_data: batches to evaluate (required: the reference sources are endless).",
        lower_bound=1,
    )
    flags.DEFINE_string(
        "optimizer",
        "adam",
        "Any Keras optimizer by name (adam, adamw, sgd, lion, ...), at --learning_rate.",
    )
    flags.DEFINE_string(
        "optimizer_config",
        "{}",
        "The optimizer's other arguments as JSON, e.g. '{\"weight_decay\": 0.01}'.",
    )
    flags.DEFINE_enum(
        "precision",
        "float32",
        ["float32", "mixed_bfloat16", "mixed_float16"],
        "Keras dtype policy of the model (mixed_float16 adds a LossScaleOptimizer).",
    )
    flags.DEFINE_integer("width", 64, "d_model / channels / units of the model.", lower_bound=1)
    flags.DEFINE_integer("depth", 2, "Blocks of the model.", lower_bound=1)
    flags.DEFINE_integer("seq_len", 64, "Transformer context length (tokens).", lower_bound=2)
    flags.DEFINE_integer("num_heads", 4, "Transformer attention heads.", lower_bound=1)
    flags.DEFINE_float(
        "dropout", 0.0, "Transformer dropout rate.", lower_bound=0.0, upper_bound=0.9
    )
    flags.DEFINE_boolean(
        "tie_embeddings",
        False,
        "Transformer: the output head reads the token embedding matrix (one variable on the "
        "first and the last stage, its gradients summed across them).",
    )


def _check_model_and_data(values: dict[str, Any]) -> bool:
    from hybrid.run.data_sources import check_source

    try:
        check_source(values["data"], values["model"])
    except ValueError as err:
        raise flags.ValidationError(
            f"--data={values['data']} --model={values['model']}: {err}"
        ) from None
    if values["model"] == "transformer" and values["width"] % values["num_heads"]:
        raise flags.ValidationError(
            f"--width={values['width']} must be divisible by --num_heads={values['num_heads']}"
        )
    return True


def _check_validation(values: dict[str, Any]) -> bool:
    from hybrid.run.data_sources import check_source

    spec, steps = values["validation_data"], values["validation_steps"]
    if spec is None:
        if steps is not None:
            raise flags.ValidationError(
                f"--validation_steps={steps} needs --validation_data (in --data's grammar)"
            )
        return True
    try:
        check_source(spec, values["model"])
    except ValueError as err:
        raise flags.ValidationError(
            f"--validation_data={spec} --model={values['model']}: {err}"
        ) from None
    if steps is None:
        raise flags.ValidationError(
            f"--validation_data={spec} needs --validation_steps=N (batches to evaluate)"
        )
    if spec.startswith("tfrecord:") and values["tfrecord_features"] is None:
        raise flags.ValidationError(
            f"--validation_data={spec} needs --tfrecord_features (the features of its files)"
        )
    return True


# Every Keras optimizer --optimizer names (``keras.optimizers.get(name)``), listed so that the
# flags are checked without importing Keras (``tests/test_keras_private.py`` pins the list).
KERAS_OPTIMIZERS = (
    "adadelta", "adafactor", "adagrad", "adam", "adamax", "adamw", "ftrl", "lamb", "lion",
    "muon", "nadam", "rmsprop", "schedulefreeadamw", "sgd",
)  # fmt: skip


def _check_optimizer(values: dict[str, Any]) -> bool:
    import json

    if values["optimizer"].lower() not in KERAS_OPTIMIZERS:
        raise flags.ValidationError(
            f"--optimizer={values['optimizer']}: not a Keras optimizer; one of "
            f"{list(KERAS_OPTIMIZERS)}"
        )
    try:
        config = json.loads(values["optimizer_config"])
    except json.JSONDecodeError as err:
        raise flags.ValidationError(
            f"--optimizer_config={values['optimizer_config']} is not JSON: {err}"
        ) from None
    if not isinstance(config, dict) or "learning_rate" in config:
        raise flags.ValidationError(
            f"--optimizer_config={values['optimizer_config']} must be a JSON object of the "
            "optimizer's arguments (the learning rate is --learning_rate)"
        )
    return True


def _check_keras_file(values: dict[str, Any]) -> bool:
    if values["keras_file"] and values["tie_embeddings"]:
        raise flags.ValidationError(
            f"--keras_file={values['keras_file']} --tie_embeddings: the tied head holds the "
            "embedding layer itself, which a .keras file cannot describe; use --export_dir "
            "(SavedModels) for a tied model"
        )
    if values["keras_file"] and not values["keras_file"].endswith(".keras"):
        raise flags.ValidationError(f"--keras_file={values['keras_file']} must end in .keras")
    return True


def _check_tfrecord(values: dict[str, Any]) -> bool:
    from hybrid.run.data_sources import parse_features

    tfrecord = values["data"].startswith("tfrecord:")
    if tfrecord != (values["tfrecord_features"] is not None):
        raise flags.ValidationError(
            f"--data={values['data']} --tfrecord_features={values['tfrecord_features']}: "
            "tfrecord data needs --tfrecord_features, and only tfrecord data takes it"
        )
    if tfrecord:
        try:
            parse_features(values["tfrecord_features"], values["tfrecord_label"])
        except ValueError as err:
            raise flags.ValidationError(f"--tfrecord_features: {err}") from None
    return True
