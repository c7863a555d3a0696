"""The SpecFlash Gradio app: ui (layout + wiring), handlers (events), runner (the engine, once
per model, errors as gr.Error), methods (knobs from the engine's configs) and the pure views
(records -> HTML and plotly figures).

Nothing is imported here, so the views load without gradio (tests, notebooks); the demo is
`app.ui.build_demo`.
"""
