"""The settings groups' choices and shared help texts (:mod:`coalescence.app.groups`): the choices
and method lists are read from the registries when the parser is built, so a registered backend,
policy, utility or method is offered with no list to keep here.
"""

from __future__ import annotations

__all__ = (
    "INDEX_HELP",
    "INDICES",
    "INTERACTIONS_HELP",
    "METHODS_HELP",
    "SPAN_HELP",
    "SUBSTRING_HELP",
    "UTILITY_HELP",
    "backend_choices",
    "method_list_help",
    "methods_help",
    "policy_choices",
    "proxy_games",
    "roles_help",
    "unit_choices",
    "utility_kinds",
)


def backend_choices() -> tuple[str, ...]:
    from ..backends.kinds import BACKENDS

    return BACKENDS.names()


def policy_choices() -> tuple[str, ...]:
    from ..masking.policies import available_policies

    return tuple(available_policies())


def proxy_games() -> tuple[str, ...]:
    """``--proxy-game``'s choices: ``auto``, ``none`` and the tail rules of the shared-KV proxy game."""
    from ..engine.proxy import proxy_game_choices

    return proxy_game_choices()


def utility_kinds() -> tuple[str, ...]:
    """The registered utility kinds (``--utility``'s choices, read when the parser is built)."""
    from ..utility import UTILITIES

    return tuple(UTILITIES)


def roles_help() -> str:
    from ..conversation import ROLES

    return (
        f"comma-separated roles whose messages are players (default: all of {','.join(ROLES)}); "
        "messages of other roles stay in every coalition"
    )


def unit_choices() -> tuple[str, ...]:
    from ..conversation import UNITS

    return UNITS


def methods_help() -> str:
    """The methods by name, read from the registry when the parser is built."""
    from ..attribution.estimators import METHODS

    return (
        f"{', '.join(METHODS)} or shapiq:NAME. " + METHODS_HELP + " (default: default; auto when --budget is given: "
        "lasso's sparse surrogate for many players on a budget under 5 per player, else regression-msr; exact with "
        "--target-stderr or --interactions)"
    )


def method_list_help() -> str:
    from ..attribution.estimators import METHODS

    return f"comma-separated methods ({','.join(METHODS)}). " + METHODS_HELP


METHODS_HELP = (
    "exact: exact Shapley values, all 2^n coalitions (n <= 16); permutation: antithetic "
    "permutation sampling with standard errors; kernelshap: KernelSHAP (paired sampling, "
    "efficiency imposed, standard errors); regression-msr: regression-adjusted KernelSHAP (Witter, "
    "Liu & Musco 2025: KernelSHAP's coalitions and fit, its residuals corrected by stratified Monte "
    "Carlo; the lowest error of the sampling methods on real games, standard errors); banzhaf: Banzhaf values (maximum sample reuse); "
    "lasso: ContextCite-style sparse linear surrogate (with a proxy game, the proxy as an unpenalised control variate); "
    "proxy-shapley: regression-msr with a proxy game as a cross-fitted control variate (unbiased; without a "
    "proxy game, regression-msr); proxy-shapley-shrunk: proxy-shapley blended toward its control's own Shapley "
    "values with jackknife weights (lower error on few exact evaluations, biased toward the control, consistent; "
    "what auto runs with a proxy game and at least 5 exact coalitions a player, lasso below); loo: leave-one-out; auto: chosen by players and "
    "budget (the output says which ran and why); default: exact on at most 16 players, else auto at 8 exact "
    "coalitions with the proxy game (64 without), measured to reach ContextCite@64's quality in about a quarter of its "
    "time on long contexts (the output says so); shapiq:NAME: "
    "a shapiq approximator through this engine (e.g. shapiq:SVARM, shapiq:KernelSHAPIQ, "
    "shapiq:ProxySPEX; needs the shapiq extra; shapiq:RegressionMSR and the other approximators of "
    "shapiq 1.5+ run in the external shapiq that make install sets up, or COALESCENCE_SHAPIQ_PYTHON names)"
)
"""What each estimator is, in one paragraph (the help of ``--method``)."""

UTILITY_HELP = (
    "what v(S) measures. Teacher forcing of the fixed answer: logprob (log p of the answer, nats), "
    "mean_logprob (per token, nats), logit_prob (log-odds of p, as in ContextCite), prob (p). "
    "Regenerate-and-compare (the model answers each coalition anew; similarity to the original "
    "answer): exact_match, token_f1, rouge_l, embedding_cosine (needs the embedding extra)"
)
"""What each utility measures (the help of ``--utility``)."""

INTERACTIONS_HELP = (
    "also compute interactions of sets of 2..ORDER players (--method exact, or a shapiq "
    "interaction approximator such as shapiq:KernelSHAPIQ, shapiq:SVARMIQ, shapiq:SHAPIQ); the "
    "--out document gets an interactions list and the table the top ones"
)
INDICES = ("SII", "k-SII", "FSII", "STII")
INDEX_HELP = "--interactions: the interaction index: SII, k-SII, FSII or STII (default: k-SII)"
SPAN_HELP = (
    "teacher-forced utilities: score only the answer tokens overlapping characters "
    "START:END of the answer (0-based, END exclusive; a span that cuts a token includes the whole "
    "token; the end-of-turn token is scored with the whole answer only) (default: the whole answer)"
)
SUBSTRING_HELP = "teacher-forced utilities: score only the answer tokens of the first occurrence of TEXT"
