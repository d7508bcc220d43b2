/*
 * Starts the JSON editor of every document field on the page (workflows.forms
 * DocumentEditorWidget). A file, not an inline script, so the admin runs under the
 * Content-Security-Policy (script-src 'self'): the widget renders without the request and so
 * without its nonce.
 *
 * The textarea is the form field and holds the user's text verbatim. It is visible until the
 * editor starts, so the page still works without JavaScript; the editor then mirrors it, and
 * copies its text back on every change and on submit, parsable or not.
 */
(function () {
    "use strict";

    function start(wrapper) {
        var container = wrapper.querySelector(".djflow-document-editor-container");
        var textarea = wrapper.querySelector("textarea.djflow-document-text");
        if (!container || !textarea || container.jsonEditor) { return; }
        var options = JSON.parse(container.dataset.options || "{}");
        var editor;
        function sync() { textarea.value = editor.getText(); }
        options.onChange = sync;
        container.style.height = container.dataset.height;
        container.style.width = container.dataset.width;
        container.hidden = false;
        editor = new JSONEditor(container, options);
        // setText, not set: the text may be the user's malformed submission, shown as typed.
        editor.setText(textarea.value);
        textarea.hidden = true;
        if (textarea.form) { textarea.form.addEventListener("submit", sync); }
        window[container.id + "_editor"] = editor;
        container.jsonEditor = editor;
    }

    function startAll() {
        if (typeof JSONEditor === "undefined") { return; }
        // Ace would check the JSON in a Web Worker built from a blob: URL, which the policy
        // refuses (worker-src falls back to script-src 'self'); JSONEditor parses and marks
        // the errors itself, so the worker only did the same work twice.
        if (JSONEditor.ace && JSONEditor.ace.config) {
            JSONEditor.ace.config.setDefaultValue("session", "useWorker", false);
        }
        document.querySelectorAll(".djflow-document-editor").forEach(start);
    }

    if (document.readyState === "loading") {
        document.addEventListener("DOMContentLoaded", startAll);
    } else {
        startAll();
    }
})();
