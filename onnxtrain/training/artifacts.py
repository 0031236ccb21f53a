"""``generate_artifacts``: training, eval and optimizer models plus the checkpoint (spec §1).

Interface note (the exact graph I/O this module writes; ``<p>`` = a trainable parameter name,
``<f>`` = a frozen one; parameters are listed in the base model's initializer order, §1.2).
Every graph is standard ONNX (default domain only), IR version = the lowest its opset allows.

Files (``prefix`` prepended): ``training_model.onnx``, ``eval_model.onnx``, ``checkpoint``,
``nominal_checkpoint`` (when asked), ``optimizer_model.onnx`` (when an optimizer is given).

``training_model.onnx``
    inputs:  user inputs of the base model (in order), inputs created by the loss
             (``target`` / ``labels`` / custom names), every trainable and frozen parameter
             (``<p>``, ``<f>``, initializer order), ``<p>_grad.accumulation.buffer`` per
             trainable parameter (same dtype/shape as ``<p>``), ``lazy_reset_grad`` BOOL[1].
    outputs: the loss (first, the differentiated value), then ``additional_output_names`` in
             order, then ``<p>_grad.accumulation.out`` per trainable parameter.
    Difference from onnxruntime (no in-place ops in standard ONNX): ``<p>_grad.accumulation.out``
    is the **new gradient buffer** (dtype/shape of ``<p>``), not a BOOL[1] flag:
    ``out = lazy_reset_grad ? <p>_grad : buffer + <p>_grad``. The runtime stores it as the new
    buffer (which is the parameter's ``.grad``).

``eval_model.onnx``
    inputs:  user inputs, loss inputs, every parameter ``<p>``/``<f>`` (no buffers, no flag).
    outputs: the loss, then ``additional_output_names``. Dropout and BatchNormalization switched
    to inference mode (BatchNormalization's running-statistics outputs removed).

``optimizer_model.onnx`` (one tensor per parameter instead of onnxruntime's sequences; every
group lists the trainable parameters in checkpoint order)
    inputs:  ``learning_rate`` FLOAT[1]; ``step`` INT64[1] (= completed steps + 1, the ``t`` of
             the bias correction); ``<p>`` for every p (params); ``<p>_grad`` for every p
             (gradients, i.e. the accumulation buffers); ``<p>.momentum0`` for every p
             (first_order_moments); AdamW only: ``<p>.momentum1`` for every p
             (second_order_moments). SGD declares ``<p>.momentum0`` but never reads it.
    outputs: ``<p>.out`` (new parameter) for every p; AdamW: ``<p>.momentum0.out`` then
             ``<p>.momentum1.out`` for every p; with ``clip_grad`` also ``<p>_grad.out``
             (the clipped gradient, which onnxruntime writes back in place) for every p.
    Rule: every output ``X.out`` is the new value of input ``X``. The per-parameter state keys
    are the checkpoint's momentum names (``momentum0``, ``momentum1``).
    metadata_props: ``onnxtrain.optimizer`` = ``AdamW`` | ``SGD``.

``checkpoint``: onnxruntime-training's format via ``onnxtrain.checkpoint`` — trainable
(requires_grad) and frozen parameters in initializer order, no optimizer group, no properties.
"""
