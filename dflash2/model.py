"""DFlash 2 drafter, in the order data flows (docs/SPEC.md §3-4): tapped target features become
context K/V; a block [anchor, MASK x (B-1)] runs through bidirectional layers with dynamic
convolutions; the target's LM head scores each slot; the candidate selector walks one path."""
import dataclasses

import torch
import torch.nn as nn
import torch.nn.functional as F

from .checkpoint import check_state_dict, read_checkpoint, write_checkpoint
from .kernels import attend, attention_mask, check_attn_backend
from .verify import sample_index


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * weight, computed in float32."""

    def __init__(self, dim, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rope_cos_sin(positions, head_dim, theta, dtype):
    """cos, sin [b, L, hd] of angle p * theta^(-2i/hd), each frequency repeated over both halves (neox)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=positions.device).float() / head_dim)
    angles = positions[..., None].float() * inv_freq
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x, cos, sin):
    """x [b, heads, L, hd] -> x * cos + rotate_half(x) * sin, rotate_half(x1, x2) = (-x2, x1)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos[:, None] + torch.cat([-x2, x1], dim=-1) * sin[:, None]


class DynamicConv(nn.Module):
    """Two-sided dynamic causal convolution inside a block.

    coef[t, s, j, c] = base_kernel[s, j, c] + delta[t, s, j, c // G],  delta = kernel_projection(u)
    Conv_s(z)_t = sum_j coef[t, s, j] * z_{t-j}, with z_{t-j} = 0 before the block start.
    Side 0 is applied to the sublayer input (prepare), side 1 to its output (finish).
    """

    def __init__(self, hidden_size, kernel_size, group_size):
        super().__init__()
        self.kernel_size, self.group_size = kernel_size, group_size
        self.base_kernel = nn.Parameter(torch.zeros(2, kernel_size, hidden_size))
        self.kernel_projection = nn.Linear(hidden_size, 2 * kernel_size * hidden_size // group_size, bias=False)
        with torch.no_grad():  # identity at init: tap 0 passes z_t through, everything else is zero
            self.base_kernel[:, 0] = 1.0
            self.kernel_projection.weight.zero_()

    def coefficients(self, u):
        """[b, T, 2, k, H] coefficients from the sublayer input u [b, T, H]."""
        b, T, H = u.shape
        delta = self.kernel_projection(u).view(b, T, 2, self.kernel_size, H // self.group_size)
        return self.base_kernel + delta.repeat_interleave(self.group_size, dim=-1)

    @staticmethod
    def conv(z, coef):
        """sum_j coef[:, t, j] * z[:, t-j]; one block per batch row, so shifts never cross blocks."""
        out = coef[:, :, 0] * z
        for j in range(1, coef.shape[2]):
            out = out + coef[:, :, j] * F.pad(z, (0, 0, j, 0))[:, : z.shape[1]]
        return out

    def prepare(self, u):
        coef = self.coefficients(u)
        return self.conv(u, coef[:, :, 0]), coef

    def finish(self, a, coef):
        return self.conv(a, coef[:, :, 1])


class Attention(nn.Module):
    """Block queries attend to [context K/V, block K/V]; QK RMSNorm per head, then RoPE."""

    def __init__(self, config, layer_idx):
        super().__init__()
        H, hd = config.hidden_size, config.head_dim
        self.head_dim = hd
        self.q_proj = nn.Linear(H, config.num_attention_heads * hd, bias=False)
        self.k_proj = nn.Linear(H, config.num_key_value_heads * hd, bias=False)
        self.v_proj = nn.Linear(H, config.num_key_value_heads * hd, bias=False)
        self.o_proj = nn.Linear(config.num_attention_heads * hd, H, bias=False)
        self.q_norm = RMSNorm(hd, config.rms_norm_eps)
        self.k_norm = RMSNorm(hd, config.rms_norm_eps)
        self.sliding_window = config.layer_window(layer_idx)
        self.causal = config.layer_causal(layer_idx)

    def kv(self, x, cos, sin):
        """K = RoPE(k_norm(k_proj(x))), V = v_proj(x), both [b, kv_heads, L, hd]."""
        b, L, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(b, L, -1, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(b, L, -1, self.head_dim).transpose(1, 2)
        return apply_rope(k, cos, sin), v

    def forward(self, u, cos, sin, ctx_k, ctx_v, mask):
        """The block's queries over [context K/V, block K/V] under mask (kernels.attention_mask)."""
        b, T, _ = u.shape
        q = apply_rope(self.q_norm(self.q_proj(u).view(b, T, -1, self.head_dim)).transpose(1, 2), cos, sin)
        k, v = self.kv(u, cos, sin)
        o = attend(q, torch.cat([ctx_k, k], dim=2), torch.cat([ctx_v, v], dim=2), mask)
        return self.o_proj(o.transpose(1, 2).reshape(b, T, -1))


class MLP(nn.Module):
    """down(silu(gate(x)) * up(x))."""

    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Pre-norm layer with a dynamic convolution around each sublayer (SPEC §3)."""

    def __init__(self, config, layer_idx):
        super().__init__()
        H, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(H, eps)
        self.attention_conv = DynamicConv(H, config.conv_kernel_size, config.conv_group_size)
        self.self_attn = Attention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(H, eps)
        self.mlp_conv = DynamicConv(H, config.conv_kernel_size, config.conv_group_size)
        self.mlp = MLP(config)

    def forward(self, x, cos, sin, ctx_k, ctx_v, mask):
        u, kappa = self.attention_conv.prepare(self.input_layernorm(x))
        a = self.self_attn(u, cos, sin, ctx_k, ctx_v, mask)
        x = x + self.attention_conv.finish(a, kappa)
        v, kappa = self.mlp_conv.prepare(self.post_attention_layernorm(x))
        return x + self.mlp_conv.finish(self.mlp(v), kappa)


class DFlash2Drafter(nn.Module):
    """fc + hidden_norm fuse the tapped target features; 5 bidirectional layers draft a block."""

    def __init__(self, config, attn_backend="sdpa"):
        super().__init__()
        config.validate()
        self.config = config
        self.attn_backend = attn_backend
        H, n = config.hidden_size, len(config.target_layer_ids)
        self.fc = nn.Linear(n * H, H, bias=False)
        self.hidden_norm = RMSNorm(H, config.rms_norm_eps)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(H, config.rms_norm_eps)
        self.candidate_selector = CandidateSelector(config)

    def rope(self, positions, dtype):
        return rope_cos_sin(positions, self.config.head_dim, self.config.rope_theta, dtype)

    def context_kv(self, target_hidden, positions):
        """Per layer (K, V) [b, kv_heads, L, hd] of ctx = hidden_norm(fc(target_hidden)) at positions.

        target_hidden [b, L, n*H]: the target's hidden_states[l + 1] for l in target_layer_ids, concatenated.
        """
        ctx = self.hidden_norm(self.fc(target_hidden))
        cos, sin = self.rope(positions, ctx.dtype)
        return [layer.self_attn.kv(ctx, cos, sin) for layer in self.layers]

    def embed_block(self, anchor_ids, embed_tokens, block_size=None):
        """embed([anchor, MASK x (B-1)]) * input_embedding_scale, [b, B, H]."""
        B = block_size or self.config.block_size
        ids = anchor_ids.new_full((anchor_ids.shape[0], B), self.config.mask_token_id)
        ids[:, 0] = anchor_ids
        return embed_tokens(ids) * self.config.input_embedding_scale

    def forward(self, block_embeds, block_positions, ctx_kv, ctx_valid, block_valid=None):
        """h = norm(layers(block_embeds)) [b, T, H], attending to ctx_kv [b, kv_heads, S, hd] per layer.

        ctx_valid [b, S] marks filled context slots (slot j holds position j). block_valid [b, T]
        (default all) marks the block slots in use: a row whose block is cut short (the end of its
        budget) drafts exactly as a block of that many slots, the rest are ignored.
        """
        b, S = ctx_valid.shape
        if block_valid is None:
            block_valid = ctx_valid.new_ones(block_positions.shape)
        k_pos = torch.cat([torch.arange(S, device=ctx_valid.device).expand(b, S), block_positions], dim=1)
        k_valid = torch.cat([ctx_valid, block_valid], dim=1)
        masks = {}  # one mask per kind of layer (window, causal), built once per forward
        x = block_embeds
        cos, sin = self.rope(block_positions, x.dtype)
        for layer, (ctx_k, ctx_v) in zip(self.layers, ctx_kv):
            kind = (layer.self_attn.sliding_window, layer.self_attn.causal)
            if kind not in masks:
                masks[kind] = attention_mask(block_positions, k_pos, k_valid, *kind, self.attn_backend)
            x = layer(x, cos, sin, ctx_k, ctx_v, masks[kind])
        return self.norm(x)

    def draft_logits(self, h, lm_head):
        """U = (h W^T) * output_multiplier, then c * tanh(U / c) if final_logit_softcapping = c; float32.

        lm_head: the target's LM head weight W [V, H], or a linear module holding it (a PackedLinear).
        """
        # as one 2-D matmul: a 3-D bf16 input can fall back to a batched matmul that copies the head
        x = h.reshape(-1, h.shape[-1]).to(lm_head.weight.dtype if isinstance(lm_head, nn.Module) else lm_head.dtype)
        U = lm_head(x) if isinstance(lm_head, nn.Module) else F.linear(x, lm_head)
        U = U.view(*h.shape[:-1], -1).float() * self.config.output_multiplier
        c = self.config.final_logit_softcapping
        return U if c is None else c * torch.tanh(U / c)

    @classmethod
    def from_pretrained(cls, path_or_hub_id, device=None, dtype=None, attn_backend=None):
        """A drafter from a directory or hub id in the published layout (checkpoint.read_checkpoint), in
        dtype (default: the checkpoint's); attn_backend as kernels.drafter_attention (None: the device's)."""
        attn_backend = check_attn_backend(attn_backend, device or "cpu")
        config, state, path = read_checkpoint(path_or_hub_id)
        with torch.device("meta"):  # no init work: every tensor comes from the checkpoint
            model = cls(config, attn_backend)
        check_state_dict(model.state_dict(), state, path)
        dtype = dtype or getattr(torch, config.dtype)
        model.load_state_dict({k: v.to(device=device or "cpu", dtype=dtype) for k, v in state.items()}, assign=True)
        return model.eval()

    def save_pretrained(self, directory, dtype=None):
        """config.json + model.safetensors in the published layout, in dtype (default: the drafter's)."""
        dtype = dtype or next(self.parameters()).dtype
        config = dataclasses.replace(self.config, dtype=str(dtype).removeprefix("torch."))
        write_checkpoint(directory, config, {k: v.to(dtype) for k, v in self.state_dict().items()})


load_drafter = DFlash2Drafter.from_pretrained  # the function form


WAITING_POSITIONS = 1024  # the most positions a context keeps waiting to be projected (DraftContext.write)


class DraftContext:
    """The drafter's KV cache: context K/V only, slot j = position j, per layer [b, kv_heads, max_len, hd].

    A row's context is every slot before its anchor; rejected drafts' rows are written too but
    stay invisible (slot >= anchor position) until overwritten, so no crop is needed.
    """

    def __init__(self, drafter, batch, max_len, device, defer=True):
        cfg = drafter.config
        self.defer = defer  # False under compiled cores: a flush of n writes would be a new shape per n
        self.drafter = drafter
        shape = (batch, cfg.num_key_value_heads, max_len, cfg.head_dim)
        dtype = next(drafter.parameters()).dtype
        self.kv = [(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
                   for _ in range(cfg.num_hidden_layers)]
        self.pending = []  # writes not yet projected: (features [b, L, n*H], positions [b, L]), in order

    def write(self, features, positions):
        """Context K/V of the target's tapped features [b, L, n*H] at positions [b, L], into slot = position.

        Writes wait, and are projected together when the context is next read: a run of plain steps pays one
        drafter projection, not one per step, and a batch that never drafts (one of many rows, where no width
        pays) never projects its prompts. They land in the order written: a later write's slots, a prompt's
        padding or a step's rejected drafts, overwrite an earlier one's. A live row's one-token writes are at
        distinct positions; a finished row's repeat its frozen slot, which nobody reads. Past WAITING_POSITIONS
        positions waiting, they are projected then: the features a long plain run keeps stay bounded."""
        self.pending.append((features, positions))
        if not self.defer or sum(f.shape[1] for f, _ in self.pending) > WAITING_POSITIONS:
            self.flush()

    def flush(self):
        """Project every waiting write at once, then write them in order: consecutive one-token writes in one
        index assignment, a wider one (a prefill, a verified block) alone."""
        if not self.pending:
            return
        features, positions = (torch.cat(t, 1) for t in zip(*self.pending))
        new = self.drafter.context_kv(features.to(self.kv[0][0].dtype), positions)
        start, groups = 0, []
        for f, _ in self.pending:
            n = f.shape[1]
            if n == 1 and groups and groups[-1][1] == 1:
                groups[-1][2] += 1
            else:
                groups.append([start, n, n])
            start += n
        self.pending = []
        rows = torch.arange(positions.shape[0], device=positions.device)[:, None]
        for a, _, n in groups:
            at = positions[:, a:a + n]
            for (k, v), (nk, nv) in zip(self.kv, new):  # index assignment, updated in place (as SlotCacheLayer._write)
                k[rows, :, at] = nk[:, :, a:a + n].transpose(1, 2)
                v[rows, :, at] = nv[:, :, a:a + n].transpose(1, 2)

    @classmethod
    def gathered(cls, parts, groups):
        """One context whose rows groups[i] (index lists covering 0..b-1) hold the rows of contexts parts[i] (a
        batch prefilled a group of rows at a time). Each part's one waiting write (its prompts', of the part's
        width) stays waiting, padded with zero features to the widest part's width: slots past a prompt are in
        its row's future, as a prompt's own padding is."""
        first = parts[0]
        ctx = cls.__new__(cls)
        ctx.defer, ctx.drafter, ctx.pending = first.defer, first.drafter, []
        if any(len(p.pending) != 1 for p in parts):
            for p in parts:
                p.flush()
        device = first.kv[0][0].device
        groups = [torch.tensor(g, device=device) for g in groups]
        b = sum(len(g) for g in groups)
        ctx.kv = []
        for layer in range(len(first.kv)):
            pair = []
            for j in range(2):
                buf = first.kv[layer][j].new_empty((b,) + first.kv[layer][j].shape[1:])
                for p, rows in zip(parts, groups):
                    buf[rows] = p.kv[layer][j]
                pair.append(buf)
            ctx.kv.append(tuple(pair))
        if first.pending:
            width = max(p.pending[0][0].shape[1] for p in parts)
            f0 = first.pending[0][0]
            features = f0.new_zeros((b, width, f0.shape[2]))
            positions = torch.arange(width, device=device).repeat(b, 1)
            for p, rows in zip(parts, groups):
                f, at = p.pending[0]
                features[rows, : f.shape[1]], positions[rows, : f.shape[1]] = f, at
            ctx.pending = [(features, positions)]
        return ctx

    def view(self, length):
        self.flush()
        return [(k[:, :, :length], v[:, :, :length]) for k, v in self.kv]

    def select_rows(self, rows):
        self.kv = [(k.index_select(0, rows), v.index_select(0, rows)) for k, v in self.kv]
        self.pending = [(f.index_select(0, rows), p.index_select(0, rows)) for f, p in self.pending]

    def copy_rows(self, rows, other):
        """Rows `rows` take over `other`'s rows (requests admitted into finished rows). Where they are all of this
        context's rows in order (a new wave), it takes other's buffers and waiting writes as they are."""
        if rows.shape[0] == self.kv[0][0].shape[0] and bool((rows == torch.arange(len(rows), device=rows.device)).all()):
            self.kv, self.pending = other.kv, other.pending
            return
        self.flush()
        other.flush()
        for (k, v), (ok, ov) in zip(self.kv, other.kv):
            k[rows], v[rows] = ok, ov


class CandidateSelector(nn.Module):
    """Top-K candidates per slot and a low-rank bilinear edge score between consecutive slots.

    S_t(a, b) = U_t(b) + < A[a] * (W h_t), Bc[b] >,  a in C_{t-1}, b in C_t  (C_0 = {anchor})
    """

    def __init__(self, config):
        super().__init__()
        self.top_k = config.selector_top_k
        self.hidden_projection = nn.Linear(config.hidden_size, config.selector_rank, bias=False)
        self.predecessor_codebook = nn.Parameter(torch.randn(config.vocab_size, config.selector_rank) * 0.02)
        self.successor_codebook = nn.Parameter(torch.zeros(config.vocab_size, config.selector_rank))

    @staticmethod
    def candidates(U, top_k):
        """C_t = top-K ids of U_t: (cand_ids [b, T-1, K], cand_logits [b, T-1, K]), descending."""
        logits, ids = U.topk(top_k, dim=-1)
        return ids, logits

    def edge_scores(self, h, U, cand_ids, anchor_ids):
        """S [b, T-1, K, K], S[:, t-1, a, b] = S_t(C_{t-1}[a], C_t[b]) for slots t = 1..T-1.

        h [b, T-1, H] and U [b, T-1, V] are slots 1..T-1. For t = 1 the predecessor set is the
        anchor repeated K times, so all K rows of S[:, 0] are equal (walks start from row 0).
        """
        b, n, K = cand_ids.shape
        prev = torch.cat([anchor_ids[:, None, None].expand(b, 1, K), cand_ids[:, :-1]], dim=1)
        wh = self.hidden_projection(h)
        bilinear = torch.einsum("btr,btar,btcr->btac", wh, self.predecessor_codebook[prev],
                                self.successor_codebook[cand_ids])
        return U.gather(-1, cand_ids)[:, :, None, :] + bilinear.to(U.dtype)

    def walk(self, S, cand_ids, temperature=0.0, generator=None):
        """Left-to-right walk: d_t = argmax_b S_t(d_{t-1}, b), or d_t ~ softmax(S_t(d_{t-1}, .) / T) over C_t.

        Returns path_ids [b, T-1] and the proposals q [b, T-1, V] (float32, zero outside C_t;
        one-hot at temperature 0) that verification divides by.
        """
        b, n, K = cand_ids.shape
        V = self.predecessor_codebook.shape[0]
        q = torch.zeros(b, n, V, device=S.device)
        path = torch.empty(b, n, dtype=torch.long, device=S.device)
        prev = torch.zeros(b, 1, 1, K, dtype=torch.long, device=S.device)
        for t in range(n):
            row = S[:, t : t + 1].gather(2, prev).view(b, K).float()
            if temperature == 0:
                idx = row.argmax(-1)
                probs = F.one_hot(idx, K).float()
            else:
                probs = torch.softmax(row / temperature, dim=-1)
                idx = sample_index(probs, generator)
            path[:, t] = cand_ids[:, t].gather(1, idx[:, None]).squeeze(1)
            q[:, t].scatter_(1, cand_ids[:, t], probs)
            prev = idx.view(b, 1, 1, 1).expand(b, 1, 1, K)
        return path, q


def dflash1_walk(U, temperature=0.0, generator=None):
    """DFlash (v1), no selector: d_t = argmax U_t, or d_t ~ softmax(U_t / T) independently per slot.

    Returns path_ids [b, T-1] and q [b, T-1, V] (one-hot at temperature 0).
    """
    if temperature == 0:
        path = U.argmax(-1)
        # written straight into float32, as the selector's walk does (F.one_hot builds an int64 copy first)
        return path, torch.zeros(U.shape, device=U.device).scatter_(-1, path[..., None], 1.0)
    q = torch.softmax(U.float() / temperature, dim=-1)
    return sample_index(q, generator), q
