"""``nn.LSTM``, ``nn.GRU`` and ``nn.RNN`` unrolled into their GEMMs, so that each is a site.

torch computes a recurrent layer in one fused op (``torch.lstm``, ``torch.gru``, ``torch.rnn_tanh``,
``torch.rnn_relu``). :func:`recurrent_reference` computes the same in Python from two GEMMs per layer and
direction, in the order ATen's CPU kernels use: the input projection of the whole sequence at once
(``ih``: x·W_ihᵀ + b_ih) and the hidden projection once per time step (``hh``: h·W_hhᵀ + b_hh), then the
cell's gates (LSTM: i, f, g, o; GRU: r, z, n with n = tanh(i_n + r·h_n) and h' = (h − n)·z + n; RNN: tanh or
ReLU), dropout between layers while training, both directions of a bidirectional layer concatenated. Each
GEMM goes through ``linear(name, x, weight, bias)``, which the runtime routes through the site
``<module>.ih_l0`` / ``<module>.hh_l0`` (``_reverse`` for the backward direction), named after the weights.

What it does not cover runs fused, and the runtime says so: packed sequences and LSTMs with ``proj_size``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

Linear = Callable[[str, torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]

#: the fused ops and their cell
CELLS = {torch.lstm: "lstm", torch.gru: "gru", torch.rnn_tanh: "rnn_tanh", torch.rnn_relu: "rnn_relu"}


def _cell(mode: str, gates_in: torch.Tensor, gates_hidden: torch.Tensor, state):
    """One time step of the cell: (new hidden, new state) from the two projections and the old state."""
    if mode == "lstm":
        hidden, cell = state
        ingate, forgetgate, cellgate, outgate = gates_hidden.add(gates_in).unsafe_chunk(4, 1)
        cell = forgetgate.sigmoid() * cell + ingate.sigmoid() * cellgate.tanh()
        hidden = outgate.sigmoid() * cell.tanh()
        return hidden, (hidden, cell)
    if mode == "gru":
        hidden = state
        reset_in, update_in, new_in = gates_in.unsafe_chunk(3, 1)
        reset_hidden, update_hidden, new_hidden = gates_hidden.unsafe_chunk(3, 1)
        reset = reset_hidden.add(reset_in).sigmoid()
        update = update_hidden.add(update_in).sigmoid()
        new = new_in.add(new_hidden.mul(reset)).tanh()
        hidden = (hidden - new).mul(update).add(new)
        return hidden, hidden
    summed = gates_hidden.add(gates_in)
    hidden = summed.tanh() if mode == "rnn_tanh" else summed.relu()
    return hidden, hidden


def recurrent_reference(
    mode: str,
    names: Sequence[str],
    inputs: torch.Tensor,
    hx: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
    weights: Sequence[torch.Tensor],
    has_biases: bool,
    num_layers: int,
    dropout: float,
    training: bool,
    bidirectional: bool,
    batch_first: bool,
    linear: Linear,
):
    """The fused op's result (LSTM: ``(output, h_n, c_n)``; GRU/RNN: ``(output, h_n)``), from its GEMMs.

    ``names``: the parameter names of ``weights`` (``weight_ih_l0``…), which name the sites.
    """
    per = 4 if has_biases else 2
    directions = 2 if bidirectional else 1
    x = inputs.transpose(0, 1) if batch_first else inputs  # (time, batch, features)
    h0 = hx[0] if mode == "lstm" else hx
    c0 = hx[1] if mode == "lstm" else None
    final_hidden, final_cell = [], []
    for layer in range(num_layers):
        outputs = []
        for direction in range(directions):
            index = layer * directions + direction
            group = weights[index * per : (index + 1) * per]
            w_ih, w_hh = group[0], group[1]
            b_ih, b_hh = (group[2], group[3]) if has_biases else (None, None)
            suffix = names[index * per][len("weight_ih_") :]
            projected = linear(f"ih_{suffix}", x, w_ih, b_ih)  # every time step's input projection at once
            state = (h0[index], c0[index]) if mode == "lstm" else h0[index]  # type: ignore[index]
            steps = range(x.shape[0] - 1, -1, -1) if direction else range(x.shape[0])
            hiddens = [None] * x.shape[0]
            for step in steps:
                previous = state[0] if mode == "lstm" else state
                hidden, state = _cell(
                    mode, projected[step], linear(f"hh_{suffix}", previous, w_hh, b_hh), state
                )
                hiddens[step] = hidden
            outputs.append(torch.stack(hiddens))  # type: ignore[arg-type]
            final_hidden.append(state[0] if mode == "lstm" else state)
            if mode == "lstm":
                final_cell.append(state[1])
        x = outputs[0] if directions == 1 else torch.cat(outputs, -1)
        if dropout > 0 and training and layer < num_layers - 1:
            x = F.dropout(x, dropout, training=True)
    output = x.transpose(0, 1) if batch_first else x
    if mode == "lstm":
        return output, torch.stack(final_hidden), torch.stack(final_cell)
    return output, torch.stack(final_hidden)
