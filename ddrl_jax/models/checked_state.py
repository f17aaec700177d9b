"""The last step shared by the weight converters: report every bad key at once, then fill the state."""
from flax import nnx


def fill_params(abstract, expected, flat, *, name, missing, unexpected, misshaped):
  """Raises one ValueError listing all problems, else returns `abstract`'s Params filled from `flat`.

  Args:
    abstract: the model from `nnx.eval_shape`.
    expected: {path tuple: ShapeDtypeStruct} of its Params.
    flat: {path tuple: numpy array} converted tensors, shapes already checked.
    name: the model, for the message (e.g. 'CosmosDiT(config)').
    missing, unexpected, misshaped: lists of human-readable key descriptions.
  """
  if missing or unexpected or misshaped:
    raise ValueError(f'state dict does not match {name}:\n'
                     f'  missing ({len(missing)}): {missing}\n'
                     f'  unexpected ({len(unexpected)}): {unexpected}\n'
                     f'  mis-shaped ({len(misshaped)}): {misshaped}')
  state = nnx.state(abstract, nnx.Param)
  for path, variable in nnx.to_flat_state(state):
    key = tuple(str(p) for p in path)
    variable.set_value(flat[key].astype(expected[key].dtype))
  return state
