// The page without a framework: refresh in place, filter as you type, show a run on focus.
// Everything works without this file; it only makes the page livelier.
(function () {
  "use strict";

  function filterRows() {
    var box = document.getElementById("filter");
    if (!box) return;
    var wanted = box.value.toLowerCase();
    document.querySelectorAll("tr.job").forEach(function (row) {
      var name = (row.getAttribute("data-job") || "").toLowerCase();
      row.hidden = wanted !== "" && name.indexOf(wanted) < 0;
    });
  }

  function showTip(event) {
    var target = event.target.closest ? event.target.closest(".run, .mark, .bucket, .point") : null;
    var tip = document.getElementById("tip");
    if (!target || !tip) return;
    var title = target.querySelector("title");
    if (title) tip.textContent = title.textContent;
  }

  function busy() {
    var active = document.activeElement;
    return active && (active.tagName === "INPUT" || active.tagName === "BUTTON" ||
                      active.tagName === "TEXTAREA") && active.id !== "filter";
  }

  function refresh() {
    var main = document.getElementById("main");
    if (!main || document.hidden || busy()) return;
    var focused = document.activeElement && document.activeElement.id;
    var typed = document.getElementById("filter");
    var text = typed ? typed.value : null;
    fetch(window.location.href, {credentials: "same-origin", headers: {"Accept": "text/html"}})
      .then(function (response) { return response.ok ? response.text() : null; })
      .then(function (html) {
        if (html === null) return;
        var fresh = new DOMParser().parseFromString(html, "text/html").getElementById("main");
        if (!fresh) return;
        main.innerHTML = fresh.innerHTML;
        var box = document.getElementById("filter");
        if (box && text !== null) box.value = text;
        if (focused && document.getElementById(focused)) document.getElementById(focused).focus();
        filterRows();
      })
      .catch(function () { /* the next round tries again */ });
  }

  document.addEventListener("DOMContentLoaded", function () {
    var main = document.getElementById("main");
    var every = main ? parseInt(main.getAttribute("data-refresh"), 10) : 0;
    document.addEventListener("input", function (event) {
      if (event.target.id === "filter") filterRows();
    });
    document.addEventListener("focusin", showTip);
    document.addEventListener("mouseover", showTip);
    filterRows();
    if (every > 0) window.setInterval(refresh, every * 1000);
    document.documentElement.classList.add("js");
  });
})();
