"""Attribution: the estimators (:mod:`.estimators`), the analytic games that test them
(:mod:`.games`) and the explanation a run returns (:mod:`.explanation`)."""

__all__: tuple[str, ...] = ()  # a namespace: its modules are the API
